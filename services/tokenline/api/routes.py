"""Every HTTP route: each one hands its validated body to its endpoint (api/endpoints/), or
answers from the ring client's state (health, readiness, metrics). The LoRA load and unload routes
are a router of their own, served only when runtime LoRA updates are allowed (app.py)."""

from __future__ import annotations

import inspect

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenline.api.endpoints.chat import Chat
from tokenline.api.endpoints.completions import Completions
from tokenline.api.endpoints.lora import LoraAdapters
from tokenline.api.endpoints.models import Models
from tokenline.api.endpoints.pooling import Classify, Embeddings, Rerank, Score
from tokenline.api.endpoints.responses import Responses, not_stored
from tokenline.api.endpoints.tokenize import Tokenize
from tokenline.api.openai.chat import ChatCompletionRequest
from tokenline.api.openai.completions import CompletionRequest
from tokenline.api.openai.lora import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from tokenline.api.openai.pooling import (
    ClassifyRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from tokenline.api.openai.responses import ResponsesRequest
from tokenline.api.openai.tokenize import DetokenizeRequest, TokenizeRequest

router = APIRouter()
lora_router = APIRouter()  # vLLM's runtime LoRA updates, off unless allowed

# The routes that hand a validated body to one endpoint method and return what it returns:
# (route name, endpoint, its method, the body's model, paths). The names are those the routes had
# as hand-written functions: the OpenAPI schema's operation ids are made from them.
_REPLY_ROUTES = (  # the endpoint builds the reply itself: JSON, or an SSE stream
    ("chat_completions", Chat, "create", ChatCompletionRequest, "/v1/chat/completions"),
    ("completions", Completions, "create", CompletionRequest, "/v1/completions"),
    ("create_response", Responses, "create", ResponsesRequest, "/v1/responses"),
)
# Responses are never stored (store=false is all we serve): every route that would read or
# change a stored one answers that it is not there. (route name, HTTP method, path)
_STORED_RESPONSE_ROUTES = (
    ("get_response", "GET", "/v1/responses/{response_id}"),
    ("delete_response", "DELETE", "/v1/responses/{response_id}"),
    ("list_input_items", "GET", "/v1/responses/{response_id}/input_items"),
    ("cancel_response", "POST", "/v1/responses/{response_id}/cancel"),
)
_DICT_ROUTES = (  # the endpoint returns a dict that FastAPI encodes
    # embeddings and reranking (a --runner pooling model)
    ("embeddings", Embeddings, "create", EmbeddingRequest, "/v1/embeddings"),
    ("rerank", Rerank, "create", RerankRequest, "/v1/rerank", "/rerank"),
    ("score", Score, "create", ScoreRequest, "/score"),
    ("classify", Classify, "create", ClassifyRequest, "/v1/classify", "/classify"),
    # vLLM's tokenizer endpoints
    ("tokenize", Tokenize, "tokenize", TokenizeRequest, "/tokenize"),
    ("detokenize", Tokenize, "detokenize", DetokenizeRequest, "/detokenize"),
)
_LORA_ROUTES = (  # vLLM's runtime LoRA updates; the endpoint builds the reply
    ("load_lora_adapter", LoraAdapters, "load", LoadLoraAdapterRequest, "/v1/load_lora_adapter"),
    (
        "unload_lora_adapter",
        LoraAdapters,
        "unload",
        UnloadLoraAdapterRequest,
        "/v1/unload_lora_adapter",
    ),
)


def _hand_body_to(name: str, endpoint: type, method: str, body_model: type, returns: type):
    async def route(body, request: Request):
        return await getattr(endpoint(request), method)(body)

    route.__name__ = route.__qualname__ = name
    # FastAPI reads the body's model (what it validates) and the return from the signature
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    route.__signature__ = inspect.Signature(
        [
            inspect.Parameter("body", positional, annotation=body_model),
            inspect.Parameter("request", positional, annotation=Request),
        ],
        return_annotation=returns,
    )
    return route


def _add_body_routes(to: APIRouter, table: tuple, returns: type) -> None:
    for name, endpoint, method, body_model, *paths in table:
        route = _hand_body_to(name, endpoint, method, body_model, returns)
        for path in paths:
            to.add_api_route(path, route, methods=["POST"])


async def _not_stored(response_id: str) -> Response:
    raise not_stored(response_id)


# ── the process and the ring ───────────────────────────────────────────────────────────────────
@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    ring_client = request.app.state.ring_client
    problem = ring_client.problem()  # the same answer admission gives at this moment
    body = {
        "ready": problem is None,
        "problem": problem,
        "draining": ring_client.draining,
        "stages": {
            s: {"instance": st.instance, "waiting": st.waiting, "running": st.running}
            for s, st in ring_client.stage_statuses.items()
        },
    }
    return JSONResponse(body, status_code=200 if problem is None else 503)


@router.get("/metrics")
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


# ── OpenAI's endpoints, vLLM's pooling, tokenizer and LoRA endpoints ───────────────────────────
@router.get("/v1/models")
async def models(request: Request) -> dict:
    return Models(request).list()


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict:
    return Models(request).get(model_id)


_add_body_routes(router, _REPLY_ROUTES, Response)
for _name, _method, _path in _STORED_RESPONSE_ROUTES:
    router.add_api_route(_path, _not_stored, methods=[_method], name=_name)
_add_body_routes(router, _DICT_ROUTES, dict)
_add_body_routes(lora_router, _LORA_ROUTES, Response)
