"""The Responses API's request body (pydantic), and the chat completion request it means.

A Responses request is translated into a `ChatCompletionRequest`, so limits, tool plans and
grammars are the very code chat runs. Every field the official client can send is either
honoured or refused with a 400 ``unsupported_parameter`` naming it; so is any field this
module does not know.

Input items and their parts ignore the fields output items carry when a client sends them back
(ids, statuses): they have no bearing on the prompt. The request itself keeps unknown fields,
so that `refuse_unserved` can name each one in its 400.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from tokenline.api.http.errors import ApiError, invalid
from tokenline.api.openai.chat import EFFORTS, ChatCompletionRequest
from tokenline.api.openai.sampling import INT32_MAX, MAX_METADATA_KEYS, Text

_ITEM = ConfigDict(extra="ignore", allow_inf_nan=False)  # ids, status, phase: no bearing


class ContentPart(BaseModel):
    model_config = _ITEM

    type: str
    text: Text | None = None
    refusal: Text | None = None  # an earlier assistant turn's refusal part


class InputItem(BaseModel):
    """One input item, of any type; `messages_of` checks which fields each type needs."""

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
    # vLLM's: lower runs earlier, with --scheduling-policy priority
    priority: int | None = Field(default=None, ge=-INT32_MAX, le=INT32_MAX)
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's (llm-d's sidecar): as chat's
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None


# ── what a request means in chat terms ─────────────────────────────────────────────────────────
def _unsupported(param: str, message: str) -> ApiError:
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
            raise _unsupported(field, f"{field} {why}")
    for field, value in (body.model_extra or {}).items():
        if value is not None:
            raise _unsupported(
                field, f"{field} is not supported by this server's Responses API; leave it out"
            )
    if body.stream_options is not None:
        if body.stream_options.include_obfuscation:
            raise _unsupported(
                "stream_options.include_obfuscation",
                "stream_options.include_obfuscation is not supported: events carry no "
                "obfuscation padding; set it to false or leave it out",
            )
        for field, value in (body.stream_options.model_extra or {}).items():
            if value is not None:
                raise _unsupported(
                    f"stream_options.{field}", f"stream_options.{field} is not supported"
                )
    if body.text is not None:
        if body.text.verbosity is not None:
            raise _unsupported(
                "text.verbosity", "text.verbosity is not supported: the model has no such setting"
            )
        for field, value in (body.text.model_extra or {}).items():
            if value is not None:
                raise _unsupported(f"text.{field}", f"text.{field} is not supported")
    if body.metadata is not None and len(body.metadata) > MAX_METADATA_KEYS:
        raise invalid("metadata", f"metadata holds at most {MAX_METADATA_KEYS} keys")


# ── translation to chat ────────────────────────────────────────────────────────────────────────
_TEXT_PARTS = ("input_text", "output_text", "text")


def _text_of(content: str | list[ContentPart] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type in _TEXT_PARTS and part.text is not None:
            texts.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            texts.append(part.refusal)
        elif part.type in (*_TEXT_PARTS, "refusal"):
            raise invalid(f"{param}[{j}]", f"{param}[{j}] of type {part.type} has no text")
        else:
            raise _unsupported(
                f"{param}[{j}].type",
                f"{param}[{j}] is of type {part.type!r}, which this server does not take: "
                "the model reads text only (input_text, output_text)",
            )
    return "".join(texts)


def _reasoning_of(content: str | list[ContentPart] | None, param: str) -> str:
    """A reasoning item's text (its summary, if any, is not the thinking and is left out)."""
    if content is None or isinstance(content, str):
        return content or ""
    for j, part in enumerate(content):
        if part.type != "reasoning_text" or part.text is None:
            raise invalid(f"{param}[{j}]", f"{param}[{j}] is not a reasoning_text part with text")
    return "".join(part.text or "" for part in content)


def _thinking_only(message: dict[str, Any]) -> bool:
    return (
        message["role"] == "assistant"
        and "reasoning" in message
        and not message["content"]
        and not message.get("tool_calls")
    )


def messages_of(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages the input means, instructions first."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    if not body.input:
        raise invalid("input", "input is empty; send a string or at least one item")
    for i, item in enumerate(body.input):
        param = f"input[{i}]"
        if item.type == "message":
            if item.role not in ("user", "system", "developer", "assistant"):
                raise invalid(
                    f"{param}.role",
                    f"{param}.role is {item.role!r}; use user, system, developer or assistant",
                )
            text = _text_of(item.content, f"{param}.content")
            last = messages[-1] if messages else None
            if item.role == "assistant" and last is not None and _thinking_only(last):
                last["content"] = text  # the answer of the turn whose thinking came first
            else:
                messages.append({"role": item.role, "content": text})
        elif item.type == "reasoning":  # an earlier turn's thinking, sent back as it came
            thought = _reasoning_of(item.content, f"{param}.content")
            messages.append({"role": "assistant", "content": "", "reasoning": thought})
        elif item.type == "function_call":
            if not item.call_id or not item.name:
                raise invalid(param, f"{param} is a function_call without call_id or name")
            call = {
                "id": item.call_id,
                "type": "function",
                # any text, as in chat: an earlier call's broken arguments are history too
                "function": {"name": item.name, "arguments": item.arguments or ""},
            }
            last = messages[-1] if messages else None
            # calls join the assistant turn they follow, as a chat reply holds text and calls
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif item.type == "function_call_output":
            if not item.call_id:
                raise invalid(f"{param}.call_id", f"{param} needs the call_id it answers")
            output = _text_of(item.output, f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:
            raise _unsupported(
                f"{param}.type",
                f"{param} is of type {item.type!r}, which this server does not take: send "
                "message, reasoning, function_call and function_call_output items",
            )
    return messages


def _tools_of(tools: list[FunctionToolIn]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise _unsupported(
                f"tools[{i}].type",
                f"tools[{i}] is a {tool.type!r} tool, which this server does not run: only "
                "function tools are served",
            )
        refused = {
            "defer_loading": bool(tool.defer_loading),
            "allowed_callers": tool.allowed_callers not in (None, ["direct"]),
            "output_schema": tool.output_schema is not None,
            **{k: v is not None for k, v in (tool.model_extra or {}).items()},
        }
        for field, asked in refused.items():
            if asked:
                raise _unsupported(
                    f"tools[{i}].{field}", f"tools[{i}].{field} is not supported; leave it out"
                )
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.parameters}
        if tool.description is not None:
            function["description"] = tool.description
        if tool.strict is not None:
            function["strict"] = tool.strict
        out.append({"type": "function", "function": function})
    return out


def _tool_choice_of(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _unsupported(
        "tool_choice",
        f"tool_choice {json.dumps(choice)[:200]} is not supported: use none, auto, required "
        'or {"type": "function", "name": ...}',
    )


def _response_format_of(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is not None and fmt.type != "json_schema" and fmt.schema_ is not None:
        raise invalid(
            "text.format.schema",
            f"a text.format of type {fmt.type} takes no schema; set type to json_schema to "
            "constrain the output to it, or leave schema out",
        )
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else {"type": fmt.type}
    if not fmt.name:
        raise invalid("text.format.name", "text.format of type json_schema needs a name")
    schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_ or {}}
    if fmt.description is not None:
        schema["description"] = fmt.description
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": schema}


# chat's parameter names, as the Responses API calls them (in params and in messages)
_RENAMES = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("].function.", "]."),
    ("messages", "input"),
)


def renamed(exc: ApiError) -> ApiError:
    """A chat error as the Responses request's own fields name it."""
    message, param = exc.message, exc.param
    for chat, ours in _RENAMES:
        message = message.replace(chat, ours)
        param = param.replace(chat, ours) if param else param
    return ApiError(exc.status, message, exc.code, param, exc.retry_after, exc.headers)


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request that means the same; a 400 naming the field if none does."""
    refuse_unserved(body)
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages_of(body),
        "max_completion_tokens": body.max_output_tokens,
        "stream": bool(body.stream),
        "response_format": _response_format_of(body.text),
        "tools": _tools_of(body.tools) if body.tools else None,
        "tool_choice": _tool_choice_of(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls is not False,
    }
    for field in ("temperature", "top_p", "priority", "kv_transfer_params"):
        if getattr(body, field) is not None:
            chat[field] = getattr(body, field)
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise invalid(
                "reasoning.effort", f"reasoning.effort is {effort!r}; use one of {EFFORTS}"
            )
        chat["reasoning_effort"] = effort
    try:
        return ChatCompletionRequest.model_validate(chat)
    except pydantic.ValidationError as exc:  # checked by chat's rules: mostly the input items
        first = exc.errors()[0]
        loc = first.get("loc", ())
        where = ".".join(str(p) for p in loc)
        reason = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        if loc and loc[0] != "messages":  # a field passed on as it was sent, or renamed
            field = str(loc[0])
            message = reason if reason.startswith(field) else f"{field}: {reason}"
            raise renamed(invalid(field, message)) from exc
        raise invalid("input", f"the input is not valid ({where}: {reason})") from exc
