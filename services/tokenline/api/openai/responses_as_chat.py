"""The chat completion request a Responses request means (`to_chat`), and chat's errors in the
Responses request's own names (`renamed`): input items become chat messages, function tools and
the tool choice chat's, ``text.format`` a ``response_format``."""

from __future__ import annotations

import json
from typing import Any

import pydantic

from tokenline.api.http.errors import ApiError, invalid
from tokenline.api.openai.chat import EFFORTS, PART_SEPARATOR, ChatCompletionRequest
from tokenline.api.openai.responses import (
    ContentPart,
    FunctionToolIn,
    ResponsesRequest,
    TextConfig,
    refuse_unserved,
    unsupported,
)

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
            raise unsupported(
                f"{param}[{j}].type",
                f"{param}[{j}] is of type {part.type!r}, which this server does not take: "
                "the model reads text only (input_text, output_text)",
            )
    return PART_SEPARATOR.join(texts)  # as chat joins a message's text parts


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
            raise unsupported(
                f"{param}.type",
                f"{param} is of type {item.type!r}, which this server does not take: send "
                "message, reasoning, function_call and function_call_output items",
            )
    return messages


def _tools_of(tools: list[FunctionToolIn]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise unsupported(
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
                raise unsupported(
                    f"tools[{i}].{field}", f"tools[{i}].{field} is not supported; leave it out"
                )
        function: dict[str, Any] = {"name": tool.name}  # OpenAI's order, as chat's tools
        if tool.description is not None:
            function["description"] = tool.description
        function["parameters"] = tool.parameters
        if tool.strict is not None:
            function["strict"] = tool.strict
        out.append({"type": "function", "function": function})
    return out


def _tool_choice_of(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise unsupported(
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


def _continues(body: ResponsesRequest) -> bool:
    """Whether the last input item is a message or reasoning item left unfinished, which the
    reply continues (as vLLM's ``should_continue_final_message`` reads it)."""
    if isinstance(body.input, str) or not body.input:
        return False
    last = body.input[-1]
    return last.type in ("message", "reasoning") and last.status in ("in_progress", "incomplete")


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
    if _continues(body):  # the reply goes on from the last item's text
        chat["add_generation_prompt"], chat["continue_final_message"] = False, True
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
