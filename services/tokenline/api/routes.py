"""Every HTTP route: each one hands its validated body to its endpoint (api/endpoints/), or
answers from the ring client's state (health, readiness, metrics). The LoRA load and unload routes
are a router of their own, served only when runtime LoRA updates are allowed (app.py)."""

from __future__ import annotations

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
            for s, st in ring_client.health.statuses.items()
        },
    }
    return JSONResponse(body, status_code=200 if problem is None else 503)


@router.get("/metrics")
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


# ── OpenAI's endpoints ─────────────────────────────────────────────────────────────────────────
@router.get("/v1/models")
async def models(request: Request) -> dict:
    return Models(request).list()


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict:
    return Models(request).get(model_id)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await Chat(request).create(body)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await Completions(request).create(body)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    return await Responses(request).create(body)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str) -> Response:
    raise not_stored(response_id)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str) -> Response:
    raise not_stored(response_id)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str) -> Response:
    raise not_stored(response_id)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str) -> Response:
    raise not_stored(response_id)


# ── embeddings and reranking (a --runner pooling model) ──────────────────────────────────────
@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> dict:
    return await Embeddings(request).create(body)


@router.post("/rerank")
@router.post("/v1/rerank")
async def rerank(body: RerankRequest, request: Request) -> dict:
    return await Rerank(request).create(body)


@router.post("/score")
async def score(body: ScoreRequest, request: Request) -> dict:
    return await Score(request).create(body)


@router.post("/classify")
@router.post("/v1/classify")
async def classify(body: ClassifyRequest, request: Request) -> dict:
    return await Classify(request).create(body)


# ── vLLM's tokenizer endpoints ─────────────────────────────────────────────────────────────────
@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    return await Tokenize(request).tokenize(body)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    return await Tokenize(request).detokenize(body)


# ── vLLM's runtime LoRA updates ────────────────────────────────────────────────────────────────
@lora_router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> Response:
    return await LoraAdapters(request).load(body)


@lora_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> Response:
    return await LoraAdapters(request).unload(body)
