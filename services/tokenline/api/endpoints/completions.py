"""``POST /v1/completions``: prompts (text or token ids) in, text out, whole or as
``text_completion`` events; with echo, the prompt (and its logprobs) in front."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from fastapi.responses import Response

from tokenline import protocol
from tokenline.api.endpoints.base import Endpoint
from tokenline.api.function_calling.grammars import completion_grammar
from tokenline.api.http.sse import DONE, RunningUsage, event
from tokenline.api.openai.completions import CompletionRequest
from tokenline.api.openai.logprobs import completion_logprobs, echoed
from tokenline.api.openai.usage import Usage
from tokenline.api.ring.exchange import NORMAL_ENDS, Exchange


class Completions(Endpoint):
    id_prefix = "cmpl-"

    async def create(self, body: CompletionRequest) -> Response:
        grammar = completion_grammar(body.response_format)
        self.admit(body, "response_format" if grammar is not None else None)
        prompts = body.prompts()
        messages = []
        for index in range(body.choices):
            prompt = prompts[index // body.n]  # choices go prompt by prompt, n each
            messages.append(
                protocol.Generate(
                    uid="",
                    sampling=msgspec.structs.replace(
                        body.sampling(index, self.request.app.state.request_defaults),
                        grammar=grammar,
                    ),
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_ids=None if isinstance(prompt, str) else prompt,
                    timeout_s=self.settings.request_timeout,
                )
            )
        return await self.generate(body, messages, CompletionsAnswer(body))


def _prompt_logprobs(ex: Exchange, index: int, per_prompt: int):
    """A choice's prompt logprobs. They are the same for the ``n`` choices of a prompt, so only
    the first asks the scheduler for them (`CompletionRequest.sampling`); the others borrow."""
    return ex.choices[index - index % per_prompt].prompt_logprobs


class CompletionsAnswer:
    """A completion's replies read as its answer; with echo, the prompt (and its logprobs) go
    in front of each choice's text."""

    def __init__(self, body: CompletionRequest) -> None:
        self.body = body
        self.prompts = body.prompts()

    def echo_text(self, ex: Exchange, index: int) -> str:
        """Choice ``index``'s prompt as echo gives it back: a text prompt as it was sent (as
        vLLM does; decoding its ids would drop special tokens' text), token ids decoded."""
        sent = self.prompts[index // self.body.n]
        return sent if isinstance(sent, str) else ex.choices[index].prompt_text or ""

    def whole(self, ex: Exchange, meta: dict) -> dict:
        body = self.body
        wanted = body.wanted_logprobs() is not None
        choices = []
        for choice in ex.choices:
            text = "".join(ex.texts[choice.index])
            logprobs = completion_logprobs(ex.logprobs[choice.index]) if wanted else None
            if body.echo:
                borrowed = _prompt_logprobs(ex, choice.index, body.n)
                prompt = self.echo_text(ex, choice.index)
                text, logprobs = echoed(prompt, borrowed, text, logprobs)
            choices.append(
                {
                    "index": choice.index,
                    "text": text,
                    "finish_reason": choice.finish_reason,
                    "logprobs": logprobs,
                }
            )
        usage = Usage.of(ex.choices, ex.cached_tokens, body.n).completions_shape()
        return {**meta, "object": "text_completion", "choices": choices, "usage": usage}

    async def stream(self, ex: Exchange, first: list, meta: dict) -> AsyncIterator[bytes]:
        body = self.body
        head = {**meta, "object": "text_completion"}
        wanted = body.wanted_logprobs() is not None
        offsets = [0] * len(ex.choices)  # per choice: where the next token's text starts
        echo_pending = [body.echo] * len(ex.choices)  # the prompt goes in front of the first piece
        running = RunningUsage(ex, body, body.n)

        def chunk(index: int, reply: protocol.Reply, finish: str | None = None) -> bytes:
            text, logprobs = reply.text, None
            if wanted:
                entries = reply.logprobs or []
                logprobs = completion_logprobs(entries, offsets[index])
                offsets[index] += sum(len(e.token) for e in entries)
            if echo_pending[index]:
                echo_pending[index] = False
                borrowed = _prompt_logprobs(ex, index, body.n)
                prompt = self.echo_text(ex, index)
                text, logprobs = echoed(prompt, borrowed, text, logprobs)
                offsets[index] += len(prompt)
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            return event({**head, "choices": [choice], **running.of_chunk()})

        # A choice that borrows its prompt's logprobs waits, before its first chunk, for the
        # prompt's first choice to bring them (or to end without them).
        waiting: dict[int, list[protocol.Reply]] = {}
        borrows = body.echo and wanted and body.n > 1

        def must_wait(index: int) -> bool:
            lender = ex.choices[index - index % body.n]
            return (
                borrows
                and echo_pending[index]
                and lender.index != index
                and lender.prompt_logprobs is None
                and not lender.finish_reason
            )

        def ready() -> list[tuple[int, protocol.Reply]]:
            out = []
            for index in [i for i in waiting if not must_wait(i)]:
                out += [(index, reply) for reply in waiting.pop(index)]
            return out

        def chunks(index: int, reply: protocol.Reply) -> list[bytes] | None:
            """The chunks a reply makes; None when it ended the stream with an error."""
            running.sent(index, reply)
            if reply.finish_reason in NORMAL_ENDS:
                return [chunk(index, reply, reply.finish_reason)]
            if reply.finish_reason:
                return None
            if reply.text or (wanted and reply.logprobs) or echo_pending[index]:
                return [chunk(index, reply)]
            return []

        async def in_order() -> AsyncIterator[tuple[int, protocol.Reply]]:
            async for index, reply in ex.replies(first):
                if index in waiting or must_wait(index):
                    waiting.setdefault(index, []).append(reply)
                    continue
                for item in [(index, reply), *ready()]:
                    yield item
            for item in ready():  # lenders that ended: nothing left to wait for
                yield item

        async for index, reply in in_order():
            out = chunks(index, reply)
            if out is None:
                yield event(ex.error_for(reply).body())
                yield DONE
                return
            for piece in out:
                yield piece
        for piece in running.final_events(head):
            yield piece
