"""The chat completion request (pydantic): its messages, tools and logprobs."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tokenline.api.openai.sampling import (
    CONFIG,
    INT32_MAX,
    MAX_METADATA_KEYS,
    MAX_TOP_LOGPROBS,
    SamplingFields,
    Text,
)
from tokenline.api.openai.tools import MAX_TOOLS, ResponseFormat, Tool, ToolChoice
from tokenline.protocol import ChatMessage, ToolCall


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


def template_variables(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """``chat_template_kwargs`` as sent, once its names are ones a request may set."""
    for name in value or {}:
        if not name.isidentifier() or name in TEMPLATE_RESERVED:
            raise ValueError(
                f"{name!r} cannot be a chat template variable: names are identifiers other "
                f"than {', '.join(sorted(TEMPLATE_RESERVED))}, which the server sets"
            )
    return value


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
EFFORTS = get_args(ReasoningEffort)

# set by the server for every chat template; a request's chat_template_kwargs may not
TEMPLATE_RESERVED = frozenset(
    {"messages", "tools", "tokenize", "add_generation_prompt", "continue_final_message"}
    | {"documents", "chat_template", "return_dict", "return_assistant_tokens_mask"}
)

# vLLM joins a message's text parts with a newline, and so does the chat template there
PART_SEPARATOR = "\n"


class ToolCallFunctionIn(BaseModel):
    model_config = CONFIG

    name: Text = Field(min_length=1)
    # Any text, as OpenAI takes it: an earlier turn's call whose arguments were not valid JSON
    # is ordinary history, and the template shows it as the text it was.
    arguments: Text


class ToolCallIn(BaseModel):
    """A call an earlier assistant turn made, sent back as part of the conversation."""

    model_config = CONFIG

    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunctionIn


# checked by a validator, so the 400 says what to do; the schema says "null"
_Empty = Annotated[Any, WithJsonSchema({"type": "null"})]


class ChatMessageIn(BaseModel):
    model_config = CONFIG

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
    # An assistant turn's thinking, as replies carry it (both names): shown to templates that
    # show it (reasoning_content), left out by the others.
    reasoning: Text | None = None
    reasoning_content: Text | None = None

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
        parts = None  # the tokenizer hands parts to templates that read them (content format)
        if isinstance(content, list):
            parts = [part.text for part in content]
            content = PART_SEPARATOR.join(parts)
        elif content is None:
            parts = []
        role = "system" if self.role == "developer" else self.role
        calls = [
            ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
            for c in self.tool_calls or []
        ]
        return ChatMessage(
            role=role,
            content=content or "",
            parts=parts,
            tool_calls=calls,
            tool_call_id=self.tool_call_id if self.role == "tool" else None,
            name=self.name,  # every role's, as vLLM hands it to the template
            reasoning=self.reasoning if self.reasoning is not None else self.reasoning_content,
        )


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # structured outputs and tools: api/function_calling/grammars.py checks them and builds
    # the grammar
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None  # deprecated by OpenAI: refused, naming tools instead
    function_call: Any = None
    # Reasoning models: the thinking comes in message.reasoning (and reasoning_content) when
    # --reasoning-parser splits it; include_reasoning false leaves it out. reasoning_effort
    # and chat_template_kwargs reach the chat template (enable_thinking, reasoning_effort),
    # which uses what it knows and ignores the rest, as vLLM passes them.
    reasoning_effort: ReasoningEffort | None = None
    include_reasoning: bool = True
    chat_template_kwargs: dict[Text, Any] | None = None
    # vLLM's: the template's generation prompt, or (continue_final_message) the last message
    # left open for the reply to continue, as transformers' apply_chat_template renders them
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Sent by current SDKs and agent frameworks, and accepted with no effect, as vLLM accepts
    # them: nothing is stored, answers are text only, and there is no web search. A value that
    # asks for something it cannot do is refused.
    metadata: Annotated[dict[Text, Text] | None, Field(max_length=MAX_METADATA_KEYS)] = None
    prompt_cache_key: Text | None = None  # prefixes are cached by content, key or not
    safety_identifier: Text | None = None
    modalities: list[Literal["text"]] | None = None
    prediction: _Empty = None
    audio: _Empty = None
    web_search_options: _Empty = None

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

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return template_variables(value)

    def template_kwargs(self) -> dict[str, Any] | None:
        """What the chat template gets beside the messages and tools. As vLLM 0.32 renders:
        reasoning_effort over the same key of chat_template_kwargs, and unless those name
        enable_thinking, thinking on for every effort but ``none`` (templates that default it
        off, as Gemma's, think when asked to; Qwen3's stops thinking at ``none``)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs or None

    @field_validator("continue_final_message")
    @classmethod
    def _one_ending(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt", True):
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true: set "
                "add_generation_prompt to false to continue the last message"
            )
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):  # 0 asks for nothing, as vLLM reads it
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def wire_messages(self) -> list[ChatMessage]:
        return [m.to_wire() for m in self.messages]
