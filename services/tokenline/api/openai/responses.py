"""The Responses API's request body (pydantic), and the fields it refuses.

A Responses request is translated into a `ChatCompletionRequest` (responses_as_chat.py), so
limits, tool plans and grammars are the very code chat runs. Every field the official client
can send is either honoured or refused with a 400 ``unsupported_parameter`` naming it; so is
any field this module does not know.

Input items and their parts ignore the fields output items carry when a client sends them back
(ids, phases): they have no bearing on the prompt. An item's ``status`` does in one place: a
last message or reasoning item still ``in_progress`` or ``incomplete`` is continued, not
answered (vLLM's partial completion). The request itself keeps unknown fields,
so that `refuse_unserved` can name each one in its 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenline.api.http.errors import ApiError, invalid
from tokenline.api.openai.sampling import INT32_MAX, MAX_METADATA_KEYS, Text
from tokenline.api.openai.tools import MAX_TOOLS

_ITEM = ConfigDict(extra="ignore", allow_inf_nan=False)  # ids, phase: no bearing


class ContentPart(BaseModel):
    model_config = _ITEM

    type: str
    text: Text | None = None
    refusal: Text | None = None  # an earlier assistant turn's refusal part


class InputItem(BaseModel):
    """One input item, of any type; `responses_as_chat.messages_of` checks which fields each
    type needs."""

    model_config = _ITEM

    type: str = "message"
    role: str | None = None
    content: Text | list[ContentPart] | None = None
    call_id: Text | None = None
    name: Text | None = None
    arguments: Text | None = None
    output: Text | list[ContentPart] | None = None
    status: str | None = None  # an output item sent back: in_progress, completed, incomplete


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
    tools: list[FunctionToolIn] | None = Field(default=None, max_length=MAX_TOOLS)
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
    # vLLM's: lower runs earlier, with --scheduling-policy priority
    priority: int | None = Field(default=None, ge=-INT32_MAX, le=INT32_MAX)
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's (llm-d's sidecar): as chat's
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None


# ── what a request asks that is not served ─────────────────────────────────────────────────
def unsupported(param: str, message: str) -> ApiError:
    return invalid(param, message, "unsupported_parameter")


_STORAGE = (
    "is not supported: this server stores no responses or conversations; send the whole "
    "conversation as input (earlier output items included)"
)
# Fields that are accepted only where they ask for nothing: (field, accepted?, why not)
_NOTHING_ASKED = (
    ("previous_response_id", lambda v: v is None, _STORAGE),
    ("conversation", lambda v: v is None, _STORAGE),
    ("background", lambda v: not v, "is not supported: responses run in the foreground only"),
    (
        "truncation",
        lambda v: v in (None, "disabled"),
        "is not supported except 'disabled': input longer than the context is refused, "
        "never cut; shorten the input",
    ),
    (
        # effort goes to the chat template, as chat's reasoning_effort; a summary is output
        # no served model gives (its thinking comes whole, as reasoning items)
        "reasoning",
        lambda v: not v or all(x is None for k, x in v.items() if k != "effort"),
        "is not supported except effort (passed to the chat template): no summary of the "
        "thinking is made (reasoning models' thinking comes whole, as reasoning items); "
        "leave the rest out",
    ),
    (
        "include",
        lambda v: not v,
        "is not supported: this server has no extra output to include; send it empty",
    ),
    (
        "service_tier",
        lambda v: v in (None, "auto", "default"),
        "is not supported except 'auto' and 'default': this server has one tier",
    ),
)


def refuse_unserved(body: ResponsesRequest) -> None:
    """A 400 ``unsupported_parameter`` for the first field asked for that is not served."""
    for field, accepted, why in _NOTHING_ASKED:
        value = getattr(body, field)
        if not accepted(value):
            raise unsupported(field, f"{field} {why}")
    for field, value in (body.model_extra or {}).items():
        if value is not None:
            raise unsupported(
                field, f"{field} is not supported by this server's Responses API; leave it out"
            )
    if body.stream_options is not None:
        if body.stream_options.include_obfuscation:
            raise unsupported(
                "stream_options.include_obfuscation",
                "stream_options.include_obfuscation is not supported: events carry no "
                "obfuscation padding; set it to false or leave it out",
            )
        for field, value in (body.stream_options.model_extra or {}).items():
            if value is not None:
                raise unsupported(
                    f"stream_options.{field}", f"stream_options.{field} is not supported"
                )
    if body.text is not None:
        if body.text.verbosity is not None:
            raise unsupported(
                "text.verbosity", "text.verbosity is not supported: the model has no such setting"
            )
        for field, value in (body.text.model_extra or {}).items():
            if value is not None:
                raise unsupported(f"text.{field}", f"text.{field} is not supported")
    if body.metadata is not None and len(body.metadata) > MAX_METADATA_KEYS:
        raise invalid("metadata", f"metadata holds at most {MAX_METADATA_KEYS} keys")
