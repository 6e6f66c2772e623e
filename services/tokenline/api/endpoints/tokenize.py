"""/tokenize and /detokenize, as vLLM serves them; answered by the tokenizer stage over the ring.

The api holds no tokenizer, so each call travels the ring like a request (`RingClient.call`),
and a chat goes through the very chat template a chat completion's prompt goes through:
``count`` is what that completion reports as ``usage.prompt_tokens``.
"""

from __future__ import annotations

import asyncio

from tokenline import protocol
from tokenline.api.endpoints.base import Endpoint
from tokenline.api.function_calling.grammars import shown_tools
from tokenline.api.openai.tokenize import DetokenizeRequest, TokenizeRequest


class Tokenize(Endpoint):
    async def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body.model)
        body.check(self.settings)
        # As a chat completion with the default tool_choice (auto) shows them to the model; the
        # format of calls is only needed to parse a reply or constrain one, and none is here.
        tools = await asyncio.to_thread(shown_tools, body.tools) if body.tools else None
        messages = body.wire_messages()

        def build(uid: str) -> protocol.TokenizeCall:
            return protocol.TokenizeCall(
                uid=uid,
                prompt=body.prompt,
                messages=messages,
                tools=tools,
                add_special_tokens=body.special_tokens,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                return_token_strs=bool(body.return_token_strs),
                template_kwargs=body.chat_template_kwargs or None,
            )

        answer = await self.call(build)
        return {
            "count": len(answer.ids),
            "max_model_len": answer.max_model_len,
            "tokens": answer.ids,
            "token_strs": answer.token_strs,
        }

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        answer = await self.call(lambda uid: protocol.TokenizeCall(uid=uid, decode=body.tokens))
        return {"prompt": answer.text or ""}
