"""What chat and completion requests share (pydantic): the sampling fields and their
translation to `SamplingParams`, and the bounds of what the wire can carry."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, get_args

import msgspec
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from tokenline.api.openai.generation_defaults import GenerationDefaults
from tokenline.protocol import KVTransferParams, SamplingParams

# Hard bounds: what the wire format and the stages can carry. The operator's tighter limits
# (--max-n, --max-tokens-limit, ...) are checked after parsing, in api/openai/request_limits.py.
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI allows
INT32_MAX = 2**31 - 1  # token counts and ids: far beyond any model, safe in every stage
# torch's seed range; a choice's seed is seed + its index among its prompt's n, within uint64
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_lone_surrogates(value: str) -> str:
    # JSON's "\ud800" escape decodes to a code point UTF-8 cannot encode: refused here rather
    # than failing in the ring's encoder. Pairs were already joined by the JSON parser.
    if not value.isascii() and _LONE_SURROGATE.search(value):
        raise ValueError(
            "the string holds a lone UTF-16 surrogate (such as \\ud800), which is not valid "
            "Unicode; send well-formed text"
        )
    return value


Text = Annotated[str, AfterValidator(_no_lone_surrogates)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]

# A field the server does not know is refused (400 ``unsupported_parameter``, errors.py), not
# ignored: a client that sends one expects it to do something. NaN and the infinities pass
# range checks they should fail (NaN compares false both ways).
CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)
MAX_LOGIT_BIAS = 300  # tokens one request may bias, as OpenAI allows
MAX_METADATA_KEYS = 16  # as OpenAI allows
LOGIT_BIAS_RANGE = 100.0
LOGIT_BIAS_SCHEMA = {
    "type": "object",
    "description": "token id (as text) -> bias added to its logit",
    "propertyNames": {"pattern": "^[0-9]{1,9}$"},
    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    "maxProperties": MAX_LOGIT_BIAS,
}


class StreamOptions(BaseModel):
    model_config = CONFIG

    include_usage: bool = False
    # vLLM's extension: every chunk carries the usage so far (needs include_usage)
    continuous_usage_stats: bool = False


_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")


def _token_id_key(key: str) -> int:
    if not _TOKEN_ID_KEY.fullmatch(key) or int(key) > INT32_MAX:
        raise ValueError(f"the key {key[:24]!r} is not a token id; keys are ids as text (0-9)")
    return int(key)


def _logit_bias(value: Any) -> dict[int, float]:
    """The raw JSON value (this runs before pydantic's own checks)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError("logit_bias must be an object of token id (as text) -> bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"{len(value)} tokens are biased; at most {MAX_LOGIT_BIAS} may be")
    bias = {}
    for key, amount in value.items():
        if isinstance(amount, bool) or not isinstance(amount, int | float):
            raise ValueError(f"the bias of token {key[:24]} must be a number from -100 to 100")
        if not -LOGIT_BIAS_RANGE <= amount <= LOGIT_BIAS_RANGE:  # NaN fails this too
            raise ValueError(f"the bias of token {key[:24]} is out of range: -100 to 100")
        bias[_token_id_key(key)] = float(amount)
    return bias


class SamplingFields(BaseModel):
    """Fields shared by both endpoints; each one works or is refused with a 400 naming it."""

    model_config = CONFIG

    @model_validator(mode="before")
    @classmethod
    def _null_is_unsent(cls, data: Any) -> Any:
        """null for a field with a default means what leaving it out means (the generation
        config's value, else the API's), as vLLM's optional sampling fields read it: clients
        that write every option out send null for the ones they leave alone."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in fields or _takes_null(fields[key])
        }

    model: Text
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=INT32_MAX)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1)  # at most --max-n (request_limits.py); never encoded itself
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    ignore_eos: bool = False
    # vLLM's: special tokens in the text (false) and the stop string (or stop token) kept
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    # Out-of-vocabulary ids are refused by the scheduler, which knows the vocabulary.
    logit_bias: Annotated[
        dict[int, float], BeforeValidator(_logit_bias), WithJsonSchema(LOGIT_BIAS_SCHEMA)
    ] = Field(default_factory=dict)
    # An end-user id, for the abuse monitoring of a provider; nothing here uses it.
    user: Text | None = None
    # Nothing is stored, so there is nothing to tag: only the defaults are accepted.
    store: Annotated[bool | None, WithJsonSchema({"enum": [False, None]})] = None
    service_tier: Literal["auto", "default"] | None = None
    # vLLM's: lower runs earlier, under --scheduling-policy priority (refused under fcfs)
    priority: int = Field(default=0, ge=-INT32_MAX, le=INT32_MAX)
    # vLLM's (NixlConnector's keys), as llm-d's routing sidecar sends them: passed to the
    # scheduler, which refuses them unless it runs with --kv-transfer-config
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("store")
    @classmethod
    def _nothing_stored(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("this server stores no completions; leave store out or false")
        return value

    @field_validator("kv_transfer_params")
    @classmethod
    def _kv_transfer_fields(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # vLLM's key names; keys of other connectors are ignored, as NixlConnector does
        if value is not None:
            try:
                msgspec.convert(value, KVTransferParams)
            except msgspec.ValidationError as exc:
                raise ValueError(f"kv_transfer_params: {exc}") from None
        return value

    @property
    def kv_transfer(self) -> KVTransferParams | None:
        params = self.kv_transfer_params
        return None if params is None else msgspec.convert(params, KVTransferParams)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        # how many and how long: api/openai/request_limits.py, from the operator's flags
        stops = [value] if isinstance(value, str) else list(value or [])
        return [s for s in stops if s]

    def wanted_tokens(self) -> int | None:
        return self.max_tokens

    def wanted_logprobs(self) -> int | None:
        """None: no logprobs; N: the chosen token's plus the top N alternatives."""
        return None

    def sampling(self, index: int, defaults: GenerationDefaults | None = None) -> SamplingParams:
        """Parameters for choice ``index``; a seeded request gives each choice its own seed.
        ``defaults`` (the model's generation config) stand in for fields the request left out."""
        sent = self.model_fields_set
        defaults = defaults or GenerationDefaults()

        def value(name: str) -> Any:
            if name in defaults.values and name not in sent:
                return defaults.values[name]
            return getattr(self, name)

        return SamplingParams(
            max_tokens=defaults.max_tokens(self.wanted_tokens()),
            temperature=value("temperature"),
            top_p=value("top_p"),
            top_k=max(value("top_k"), 0),
            min_p=value("min_p"),
            # each prompt's choices draw seed, seed + 1, ... (vLLM's n children of a prompt)
            seed=None if self.seed is None else self.seed + index % self.n,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            stop=list(self.stop or []),
            stop_token_ids=self.stop_token_ids,
            repetition_penalty=value("repetition_penalty"),
            frequency_penalty=value("frequency_penalty"),
            presence_penalty=value("presence_penalty"),
            logprobs=self.wanted_logprobs(),
            logit_bias=self.logit_bias,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            kv_transfer=self.kv_transfer,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    @field_validator("stream_options")
    @classmethod
    def _options_of_a_stream(
        cls, options: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if options is None:
            return None
        if not info.data.get("stream"):
            raise ValueError("stream_options is only for streamed requests; set stream to true")
        if options.continuous_usage_stats and not options.include_usage:
            raise ValueError("continuous_usage_stats needs include_usage set to true")
        return options


def _takes_null(field: FieldInfo) -> bool:
    """Whether null is the field's own value (completions' max_tokens: to the context), or
    wrong (a required field: its 400 says what it should be)."""
    return field.is_required() or type(None) in get_args(field.annotation)
