"""/tokenize and /detokenize, as vLLM serves them; answered by the tokenizer stage over the ring.

The api holds no tokenizer, so each call travels the ring like a request (`Pipeline.call`),
and a chat is rendered by the very code that renders a chat completion's prompt: ``count``
is what that completion reports as ``usage.prompt_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request

from tokenline import protocol
from tokenline.api.http.errors import ApiError, unencodable
from tokenline.api.openai.tokenize import DetokenizeRequest, TokenizeRequest
from tokenline.api.ring.pipeline import Pipeline
from tokenline.api.tools import grammars as structured

router = APIRouter()


def _pipeline(request: Request, model: str | None) -> Pipeline:
    pipeline: Pipeline = request.app.state.pipeline
    if model is not None and model != pipeline.model:
        raise ApiError(
            404,
            f"The model `{model}` does not exist; this server serves `{pipeline.model}` "
            "(see /v1/models).",
            "model_not_found",
            "model",
        )
    return pipeline


async def _call(
    pipeline: Pipeline, build: Callable[[str], protocol.TokenizeCall]
) -> protocol.TokenizerAnswer:
    try:
        return await pipeline.call(build)
    except (OverflowError, UnicodeError) as exc:  # as in routes.py: a gap in the schemas
        raise unencodable(exc) from exc


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    pipeline = _pipeline(request, body.model)
    body.check(request.app.state.settings)
    tools = None
    if body.tools:
        # As a chat completion with the default tool_choice (auto) shows them to the model;
        # the format of calls is only needed to parse a reply, and there is none here.
        tools = structured.plan_tools(body.tools, None, True, None, None).tools
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
        )

    answer = await _call(pipeline, build)
    return {
        "count": len(answer.ids),
        "max_model_len": answer.max_model_len,
        "tokens": answer.ids,
        "token_strs": answer.token_strs,
    }


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    pipeline = _pipeline(request, body.model)
    answer = await _call(pipeline, lambda uid: protocol.TokenizeCall(uid=uid, decode=body.tokens))
    return {"prompt": answer.text or ""}
