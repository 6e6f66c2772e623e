"""The Responses API's request body (pydantic): what `POST /v1/responses` reads.

Input items and their parts ignore the fields output items carry when a client sends them back
(ids, statuses): they have no bearing on the prompt. The request itself keeps unknown fields,
so that `responses.refuse_unserved` can name each one in its 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenline.api.openai.chat import INT32_MAX, Text

_ITEM = ConfigDict(extra="ignore", allow_inf_nan=False)  # ids, status, phase: no bearing


class ContentPart(BaseModel):
    model_config = _ITEM

    type: str
    text: Text | None = None
    refusal: Text | None = None  # an earlier assistant turn's refusal part


class InputItem(BaseModel):
    """One input item, of any type; `_messages` checks which fields each type needs."""

    model_config = _ITEM

    type: str = "message"
    role: str | None = None
    content: Text | list[ContentPart] | None = None
    call_id: Text | None = None
    name: Text | None = None
    arguments: Text | None = None
    output: Text | list[ContentPart] | None = None


class FunctionToolIn(BaseModel):
    """A tool in the Responses flat shape; only functions are served."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None
    output_schema: dict[str, Any] | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    format: TextFormat | None = None
    verbosity: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    include_obfuscation: bool | None = None


class ResponsesRequest(BaseModel):
    # Unknown fields are kept so that `refuse_unserved` can name them, not dropped unseen.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: Text
    input: Text | list[InputItem]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    tools: list[FunctionToolIn] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool | None = None  # accepted either way; nothing is ever stored
    metadata: dict[Text, Text] | None = None
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None  # prefixes are cached by content, key or not
    service_tier: str | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
