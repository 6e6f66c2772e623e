"""``POST /v1/chat/completions``: messages and tools in, an assistant message out, whole or
as ``chat.completion.chunk`` events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
from fastapi.responses import Response

from tokenline import protocol
from tokenline.api.endpoints.base import Endpoint
from tokenline.api.function_calling import chat_calls
from tokenline.api.function_calling.formats import ToolCallFormat, format_for
from tokenline.api.function_calling.grammars import ToolPlan, plan_tools, refuse_deprecated
from tokenline.api.http.sse import DONE, RunningUsage, event
from tokenline.api.openai.chat import ChatCompletionRequest
from tokenline.api.openai.logprobs import chat_logprobs
from tokenline.api.openai.usage import Usage
from tokenline.api.ring.exchange import NORMAL_ENDS, Exchange
from tokenline.model_source import chat_template_text, special_tokens


class Chat(Endpoint):
    id_prefix = "chatcmpl-"

    async def create(self, body: ChatCompletionRequest) -> Response:
        refuse_deprecated(body.functions, body.function_call)
        plan = await self.plan(body)
        self.admit(body, grammar_param(plan))
        return await self.generate(body, self.messages(body, plan), ChatAnswer(body, plan.parser))

    async def plan(self, chat: ChatCompletionRequest) -> ToolPlan:
        """What the request's tools and response_format mean for its sampling and its reply."""
        fmt = await self.tool_format() if chat.tools else None
        # Checking schemas and compiling grammars costs CPU in proportion to the request: on a
        # worker thread, the api's loop keeps serving every other request meanwhile.
        return await asyncio.to_thread(
            plan_tools,
            chat.tools,
            chat.tool_choice,
            chat.parallel_tool_calls,
            chat.response_format,
            fmt,
        )

    async def tool_format(self) -> ToolCallFormat:
        """The model's tool-call format: --tool-call-parser, or read once from its template;
        with the markers that are special tokens of its vocabulary, read once too."""
        state = self.request.app.state
        if getattr(state, "tool_format", None) is None:
            settings = self.settings
            template = None
            if settings.tool_call_parser == "auto":
                template = await asyncio.to_thread(
                    chat_template_text,
                    settings.model,
                    settings.model_cache_dir,
                    settings.revision,
                    settings.chat_template,
                )
            fmt = format_for(template, settings.tool_call_parser)
            # markers that are special tokens are written as those tokens, and the reply
            # keeps them (skip_special_tokens False) for the parser
            special = await asyncio.to_thread(
                special_tokens, settings.model, settings.model_cache_dir, settings.revision
            )
            fmt = fmt.for_vocabulary(special)
            state.tool_format = fmt
        return state.tool_format

    def messages(self, chat: ChatCompletionRequest, plan: ToolPlan) -> list[protocol.Generate]:
        """What each choice sends into the ring (its uid is given at admission)."""
        wire, template_kwargs = chat.wire_messages(), chat.template_kwargs()
        return [
            protocol.Generate(
                uid="",
                sampling=msgspec.structs.replace(
                    chat.sampling(index, self.request.app.state.request_defaults),
                    grammar=plan.grammar,
                    reasoning=True,
                    # the parser must see markers that are special tokens (vLLM's Mistral
                    # parser asks the same), whatever the request's skip_special_tokens
                    skip_special_tokens=chat.skip_special_tokens
                    and (plan.parser is None or not plan.parser.special_markers),
                ),
                messages=wire,
                tools=plan.tools,
                timeout_s=self.settings.request_timeout,
                template_kwargs=template_kwargs,
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message,
            )
            for index in range(chat.n)
        ]


def grammar_param(plan: ToolPlan) -> str | None:
    """The field whose answer follows the plan's grammar, or None: free text."""
    if plan.grammar is None:
        return None
    return "tools" if plan.tools is not None else "response_format"


class ChatAnswer:
    """A chat completion's replies read as its answer; tool calls are parsed out of the text
    with ``parser`` (None: the request has no tools)."""

    def __init__(self, body: ChatCompletionRequest, parser: ToolCallFormat | None) -> None:
        self.body, self.parser = body, parser
        self.wanted = body.wanted_logprobs() is not None
        self.show_reasoning = body.include_reasoning

    def whole(self, ex: Exchange, meta: dict) -> dict:
        choices = []
        for choice in ex.choices:
            text = "".join(ex.texts[choice.index])
            message, has_calls = chat_calls.message(text, self.parser)
            reasoning = "".join(ex.reasoning[choice.index])
            if reasoning and self.show_reasoning:  # both names: clients read one or the other
                message["reasoning"] = message["reasoning_content"] = reasoning
            logprobs = ex.logprobs[choice.index]
            choices.append(
                {
                    "index": choice.index,
                    "message": message,
                    "finish_reason": chat_calls.finish_reason(choice.finish_reason, has_calls),
                    "logprobs": chat_logprobs(logprobs) if self.wanted else None,
                }
            )
        usage = Usage.of(ex.choices, ex.cached_tokens, self.body.n).completions_shape()
        return {**meta, "object": "chat.completion", "choices": choices, "usage": usage}

    async def stream(self, ex: Exchange, first: list, meta: dict) -> AsyncIterator[bytes]:
        head = {**meta, "object": "chat.completion.chunk"}
        running = RunningUsage(ex, self.body, self.body.n)

        def chunk(
            index: int, delta: dict, finish: str | None = None, logprobs: dict | None = None
        ) -> bytes:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return event({**head, "choices": [choice], **running.of_chunk()})

        parser = self.parser
        calls = {c.index: chat_calls.DeltaStream(parser) for c in ex.choices} if parser else {}
        for choice in ex.choices:
            yield chunk(choice.index, {"role": "assistant", "content": ""})
        async for index, reply in ex.replies(first):
            running.sent(index, reply)
            if reply.reasoning and self.show_reasoning:
                thought = reply.reasoning
                yield chunk(index, {"reasoning": thought, "reasoning_content": thought})
            if index in calls:  # tool calls are parsed out of the text before it is sent
                deltas = calls[index].feed(reply.text)
                if reply.finish_reason is not None:
                    deltas += calls[index].finish()
                if self.wanted and reply.logprobs:
                    yield chunk(index, {"content": ""}, logprobs=chat_logprobs(reply.logprobs))
                for delta in deltas:
                    yield chunk(index, delta)
            elif self.wanted and reply.logprobs:
                # tokens whose text is still held back get their chunk now, with empty content
                logprobs = chat_logprobs(reply.logprobs)
                yield chunk(index, {"content": reply.text}, logprobs=logprobs)
            elif reply.text:
                yield chunk(index, {"content": reply.text})
            if reply.finish_reason in NORMAL_ENDS:
                has_calls = index in calls and calls[index].has_calls
                yield chunk(index, {}, chat_calls.finish_reason(reply.finish_reason, has_calls))
            elif reply.finish_reason:
                yield event(ex.error_for(reply).body())
                yield DONE
                return
        for piece in running.final_events(head):
            yield piece
