"""HTTP routes: OpenAI completions and chat completions, models, health, readiness, metrics."""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenline import protocol
from tokenline.api.endpoints.base import (
    Renderer,
    chat_builder,
    check_model,
    pipeline_of,
    serve,
    tool_format,
)
from tokenline.api.endpoints.completions import chat_events, completion_events, full_response
from tokenline.api.openai.chat import ChatCompletionRequest, CompletionRequest
from tokenline.api.tools import grammars as structured

router = APIRouter()


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    pipeline = pipeline_of(request)
    problem = pipeline.problem()  # the same answer admission gives at this moment
    body = {
        "ready": problem is None,
        "problem": problem,
        "draining": pipeline.draining,
        "stages": {
            s: {"instance": st.instance, "waiting": st.waiting, "running": st.running}
            for s, st in pipeline.stage_statuses.items()
        },
    }
    return JSONResponse(body, status_code=200 if problem is None else 503)


@router.get("/metrics")
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def _model_card(request: Request) -> dict:
    return {
        "id": pipeline_of(request).model,
        "object": "model",
        "created": request.app.state.started,
        "owned_by": "tokenline",
    }


@router.get("/v1/models")
async def models(request: Request) -> dict:
    return {"object": "list", "data": [_model_card(request)]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict:
    check_model(request, model_id)
    return _model_card(request)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    structured.refuse_deprecated(body.functions, body.function_call)
    fmt = await tool_format(request) if body.tools else None
    plan = structured.plan_tools(
        body.tools, body.tool_choice, body.parallel_tool_calls, body.response_format, fmt
    )
    body._tool_plan = plan
    build = chat_builder(request, body, plan)
    render = Renderer(
        "chatcmpl-",
        lambda ex, first, meta: chat_events(ex, body, first, meta),
        lambda ex, meta: full_response(ex, body, meta, chat=True),
    )
    return await serve(request, body, body.n, build, render)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    grammar = structured.completion_grammar(body.response_format)
    prompts = body.prompts()

    def build(uid: str, index: int) -> protocol.Generate:
        prompt = prompts[index // body.n]  # choices go prompt by prompt, n each
        return protocol.Generate(
            uid=uid,
            sampling=msgspec.structs.replace(body.sampling(index), grammar=grammar),
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_ids=None if isinstance(prompt, str) else prompt,
            timeout_s=pipeline_of(request).settings.request_timeout,
        )

    render = Renderer(
        "cmpl-",
        lambda ex, first, meta: completion_events(ex, body, first, meta),
        lambda ex, meta: full_response(ex, body, meta, chat=False),
    )
    return await serve(request, body, body.choices, build, render)
