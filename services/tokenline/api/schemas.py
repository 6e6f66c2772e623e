"""OpenAI-compatible request bodies (pydantic) and their translation to sampling parameters."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tokenline.api.structured import ResponseFormat, Tool, ToolChoice, ToolPlan
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

# NaN and the infinities pass range checks they should fail (NaN compares false both ways)
_CONFIG = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _CONFIG

    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints. Unknown fields are ignored, as OpenAI clients send many."""

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
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = _CONFIG

    type: Literal["text"]
    text: Text


def _json_object_text(value: str) -> str:
    try:
        decoded = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"the arguments are not JSON ({exc}); send a JSON object as text") from exc
    if not isinstance(decoded, dict):
        raise ValueError("the arguments must be a JSON object, as text")
    return value


class ToolCallFunctionIn(BaseModel):
    model_config = _CONFIG

    name: Text = Field(min_length=1)
    arguments: Annotated[Text, AfterValidator(_json_object_text)]


class ToolCallIn(BaseModel):
    """A call an earlier assistant turn made, sent back as part of the conversation."""

    model_config = _CONFIG

    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunctionIn


class ChatMessageIn(BaseModel):
    model_config = _CONFIG

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: Text | None = None  # tool turns: the call answered
    name: Text | None = None

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
            content = "".join(part.text for part in content)
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
    _tool_plan: ToolPlan | None = PrivateAttr(default=None)  # set by the route once checked

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


class CompletionRequest(_SamplingFields):
    prompt: Text | list[Text]
    response_format: ResponseFormat | None = None  # as vLLM accepts it; api/structured.py
    max_tokens: int | None = Field(default=16, ge=1, le=INT32_MAX)  # OpenAI's default
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS, strict=True)

    def wanted_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str:
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError("send one prompt per request (a list of exactly one string)")
            return value[0]
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported; leave it false")
        return value
