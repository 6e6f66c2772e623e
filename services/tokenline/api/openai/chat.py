"""OpenAI-compatible request bodies (pydantic) and their translation to sampling parameters."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tokenline.api.tools.grammars import ResponseFormat, Tool, ToolChoice, ToolPlan
from tokenline.protocol import ChatMessage, SamplingParams, ToolCall

# Hard bounds: what the wire format and the stages can carry. The operator's tighter limits
# (--max-n, --max-tokens-limit, ...) are checked after parsing, in api/limits.py.
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI allows
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs, as OpenAI allows
INT32_MAX = 2**31 - 1  # token counts and ids: far beyond any model, safe in every stage
# torch's seed range; each choice's seed is seed + index, still within MessagePack's uint64
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
_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)
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
    model_config = _CONFIG

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


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints; each one works or is refused with a 400 naming it."""

    model_config = _CONFIG

    model: Text
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=INT32_MAX)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1)  # at most --max-n (limits.py); never encoded itself
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    ignore_eos: bool = False
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

    @field_validator("store")
    @classmethod
    def _nothing_stored(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("this server stores no completions; leave store out or false")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        # how many and how long: api/limits.py, from the operator's flags
        stops = [value] if isinstance(value, str) else list(value or [])
        return [s for s in stops if s]

    def wanted_tokens(self) -> int | None:
        return self.max_tokens

    def wanted_logprobs(self) -> int | None:
        """None: no logprobs; N: the chosen token's plus the top N alternatives."""
        return None

    def sampling(self, index: int) -> SamplingParams:
        """Parameters for choice ``index``; a seeded request gives each choice its own seed."""
        return SamplingParams(
            max_tokens=self.wanted_tokens(),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            seed=None if self.seed is None else self.seed + index,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            stop=list(self.stop or []),
            stop_token_ids=self.stop_token_ids,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            logprobs=self.wanted_logprobs(),
            logit_bias=self.logit_bias,
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


class ContentPart(BaseModel):
    """A part of a message's content; only text is served, other types are named in the 400."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    # Any type is read, so the 400 can name it; the schema says what is served.
    type: Annotated[str, WithJsonSchema({"type": "string", "enum": ["text"]})]
    text: Annotated[Text | None, WithJsonSchema({"type": "string"})] = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(
                f"only text content parts are supported; this part's type is `{self.type}`"
            )
        if self.text is None:
            raise ValueError("a text content part needs its `text`")
        for name in self.model_extra or {}:  # other types' fields are allowed only to be named
            raise PydanticCustomError(
                "extra_forbidden", "`{field}` is not a field of a text part", {"field": name}
            )
        return self


# vLLM joins a message's text parts with a newline, and so does the template render there
PART_SEPARATOR = "\n"


class ToolCallFunctionIn(BaseModel):
    model_config = _CONFIG

    name: Text = Field(min_length=1)
    # Any text, as OpenAI takes it: an earlier turn's call whose arguments were not valid JSON
    # is ordinary history, and the template shows it as the text it was.
    arguments: Text


class ToolCallIn(BaseModel):
    """A call an earlier assistant turn made, sent back as part of the conversation."""

    model_config = _CONFIG

    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunctionIn


# checked by a validator, so the 400 says what to do; the schema says "null"
_Empty = Annotated[Any, WithJsonSchema({"type": "null"})]


class ChatMessageIn(BaseModel):
    model_config = _CONFIG

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: Text | None = None  # tool turns: the call answered
    name: Text | None = None
    # What the official client puts on an assistant message it returned, so that message can be
    # sent back as it came: accepted when empty, since none of them is served.
    refusal: _Empty = None
    audio: _Empty = None
    function_call: _Empty = None
    annotations: list[Any] | None = None

    @field_validator("refusal", "audio", "function_call")
    @classmethod
    def _left_empty(cls, value: Any, info: ValidationInfo) -> None:
        if value:
            hint = "; use tool_calls" if info.field_name == "function_call" else ""
            raise ValueError(f"{info.field_name} is not served on input messages{hint}; send null")
        return None

    @model_validator(mode="after")
    def _tool_turns_answer_a_call(self) -> ChatMessageIn:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def to_wire(self) -> ChatMessage:
        content = self.content
        if isinstance(content, list):
            content = PART_SEPARATOR.join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        calls = [
            ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
            for c in self.tool_calls or []
        ]
        return ChatMessage(
            role=role,
            content=content or "",
            tool_calls=calls,
            tool_call_id=self.tool_call_id if self.role == "tool" else None,
            name=self.name if self.role == "tool" else None,
        )


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # structured outputs and tools: api/structured.py checks them and builds the grammar
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None  # deprecated by OpenAI: refused, naming tools instead
    function_call: Any = None
    # Sent by current SDKs and agent frameworks, and accepted with no effect on this model, as
    # vLLM accepts them: it does not reason, stores nothing, answers in text only and has no
    # web search. A value that asks for something it cannot do is refused.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    metadata: Annotated[dict[Text, Text] | None, Field(max_length=MAX_METADATA_KEYS)] = None
    prompt_cache_key: Text | None = None  # prefixes are cached by content, key or not
    safety_identifier: Text | None = None
    modalities: list[Literal["text"]] | None = None
    prediction: _Empty = None
    audio: _Empty = None
    web_search_options: _Empty = None
    _tool_plan: ToolPlan | None = PrivateAttr(default=None)  # set by the route once checked

    @field_validator("prediction", "audio", "web_search_options")
    @classmethod
    def _not_served(cls, value: Any, info: ValidationInfo) -> None:
        if value is not None:
            what = {
                "prediction": "predicted outputs are not served",
                "audio": "this model answers in text only",
                "web_search_options": "this server has no web search",
            }[info.field_name]
            raise ValueError(f"{info.field_name} is not supported: {what}; send null")
        return None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def wire_messages(self) -> list[ChatMessage]:
        return [m.to_wire() for m in self.messages]


Prompt = str | list[int]  # text, or token ids


class CompletionRequest(_SamplingFields):
    # One prompt or a list; each as text or as token ids. Choices go prompt by prompt, n each.
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    response_format: ResponseFormat | None = None  # as vLLM accepts it; api/structured.py
    # OpenAI's default; 0 generates nothing: with echo and logprobs, it scores the prompt
    max_tokens: int | None = Field(default=16, ge=0, le=INT32_MAX)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS, strict=True)
    best_of: int | None = Field(default=None, ge=1)
    suffix: Text | None = Field(default=None, json_schema_extra={"maxLength": 0})

    def wanted_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, value: list) -> list:
        if isinstance(value, list):
            if not value:
                raise ValueError("the prompt list is empty; send a prompt")
            if any(isinstance(p, list) and not p for p in value):
                raise ValueError("a prompt of token ids is empty; send at least one id")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError(
                "suffix (insertion) is not supported: the served model has no fill-in-the-middle"
                " format here; put all the text in the prompt"
            )
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value != n:
            raise ValueError(
                f"best_of is {value} and n is {n}: this server returns every sequence it "
                "generates, so best_of must equal n (or be left out)"
            )
        return value

    def prompts(self) -> list[Prompt]:
        """Each prompt of the request, as text or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], int):
            return [list(self.prompt)]
        return list(self.prompt)

    @property
    def choices(self) -> int:
        return len(self.prompts()) * self.n

    def sampling(self, index: int) -> SamplingParams:
        params = super().sampling(index)
        if not self.echo:
            return params
        # The prompt's logprobs are the same for its n choices: the first computes them, the
        # others borrow them (api/render.py) and may take the prompt from the prefix cache.
        first_of_prompt = index % self.n == 0
        prompt_logprobs = self.logprobs if first_of_prompt else None
        return msgspec.structs.replace(params, echo=True, prompt_logprobs=prompt_logprobs)
