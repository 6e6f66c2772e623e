"""``POST /v1/embeddings`` (OpenAI's), ``/rerank`` and ``/v1/rerank`` (the Cohere/Jina shape vLLM
serves), ``/score`` and ``/classify`` (vLLM's): inputs pooled by a ``--runner pooling``
scheduler, one uid an input, answered whole.

Embeddings need an embedding model. Rerank and score take a cross-encoder (a classifier of one
label: each (query, document) pair read together, its logit through a sigmoid, as
sentence-transformers' CrossEncoder scores) or an embedding model (the cosine of the two
texts' embeddings, as vLLM does). Classify takes a classifier: each input's probabilities
(softmax over the labels; a sigmoid for one label or a multi-label classifier; a regression
head's values as they are, as vLLM reads the config's problem_type) and its most likely
label. A pooling request to a generating model, or one the model's task cannot answer, is a
400 that names the mismatch.
"""

from __future__ import annotations

import asyncio
import base64
import math
import time

import numpy as np
from fastapi import Request

from tokenline import protocol
from tokenline.api.endpoints.base import Endpoint
from tokenline.api.http.errors import ApiError, ended_with, invalid, unencodable
from tokenline.api.openai.pooling import (
    ClassifyRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from tokenline.api.ring.exchange import NORMAL_ENDS


class Pooling(Endpoint):
    """What the pooling endpoints share: the model's pooling checked, inputs pooled."""

    def __init__(self, request: Request) -> None:
        super().__init__(request)
        self.prompt_tokens = 0

    def served(self, endpoint: str) -> protocol.PoolingInfo:
        """What the scheduler pools; a 400 naming the mismatch when it generates instead."""
        status = self.ring_client.health.statuses.get("scheduler")
        if status is None:  # no heartbeat has come back yet: the ring is not up
            problem = self.ring_client.problem() or "the scheduler has not reported yet"
            raise ApiError(
                503,
                f"the pipeline is not ready ({problem}); retry shortly",
                "stage_unavailable",
                retry_after=1,
            )
        if status.pooling is None:
            raise invalid(
                "model",
                f"{endpoint} needs a pooling model, but this model is served with --runner "
                "generate (it generates text: use /v1/chat/completions or /v1/completions); "
                "serve an embedding or reranking model with --runner pooling",
            )
        return status.pooling

    def served_for(self, endpoint: str, task: str, refusal: str) -> protocol.PoolingInfo:
        """What the scheduler pools, when its task is ``task``; else a 400 saying ``refusal``."""
        info = self.served(endpoint)
        if info.task != task:
            raise invalid("model", refusal)
        return info

    def check_chars(self, texts: list, param: str) -> None:
        size = sum(len(t) for t in texts)
        if size > self.settings.max_prompt_chars:
            raise invalid(
                param,
                f"the inputs hold {size} characters (or token ids); this server allows at most "
                f"{self.settings.max_prompt_chars} (--max-prompt-chars)",
                "limit_exceeded",
            )

    async def pool(self, messages: list[protocol.Generate]) -> list[np.ndarray]:
        """Send one message an input into the ring; each input's float32 result, in order.
        Raises the request's `ApiError` when it fails or is aborted."""
        ring_client = self.ring_client
        try:
            ex = ring_client.open(messages)
        except (OverflowError, UnicodeError) as exc:  # a gap in the schemas, as in `generate`
            raise unencodable(exc) from exc
        watcher = asyncio.create_task(self._watch_disconnect(ex))
        results: list[np.ndarray | None] = [None] * len(messages)
        try:
            while True:
                batch = await ex.next_batch()
                for index, reply in batch:
                    if reply.pooled is not None:
                        results[index] = np.frombuffer(reply.pooled, dtype="<f4")
                if not batch and ex.done:
                    break
        except Exception:
            ring_client.close(ex, "stage_failure")  # the api's own failure, not the client's
            raise
        finally:
            watcher.cancel()
            ring_client.close(ex)
        if ex.error is not None:
            raise ex.error
        failed = [c for c in ex.choices if c.finish_reason not in NORMAL_ENDS]
        if failed:
            raise failed[0].error or ended_with(failed[0].finish_reason)
        if any(r is None for r in results):
            raise ended_with("error")
        self.prompt_tokens = sum(c.prompt_tokens for c in ex.choices)
        return results

    async def pool_inputs(
        self, inputs: list[str | list[int]], params: protocol.PoolingParams
    ) -> list[np.ndarray]:
        """A request's ``input`` texts (or token ids) pooled with ``params``, in order."""
        self.check_chars(inputs, "input")
        return await self.pool([self.message(text, params) for text in inputs])

    def listed(self, kind: str, data: list[dict], **usage: int) -> dict:
        """The reply of a request whose results are a list (OpenAI's ``"object": "list"``)."""
        return {
            "id": f"{kind}-{self.ring_client.new_uid()}",
            "object": "list",
            "created": int(time.time()),
            "model": self.model_name,
            "data": data,
            "usage": {
                "prompt_tokens": self.prompt_tokens,
                "total_tokens": self.prompt_tokens,
                **usage,
            },
        }

    def message(self, text: str | list[int], params: protocol.PoolingParams) -> protocol.Generate:
        return protocol.Generate(
            uid="",
            sampling=protocol.SamplingParams(max_tokens=0),
            prompt=text if isinstance(text, str) else None,
            prompt_ids=None if isinstance(text, str) else text,
            timeout_s=self.settings.request_timeout,
            pooling=params,
        )

    async def scores(self, endpoint: str, pairs: list[tuple[str, str]]) -> list[float]:
        """Each (first, second) pair's relevance: a cross-encoder's sigmoid, or the cosine of
        an embedding model's two embeddings."""
        info = self.served(endpoint)
        self.check_chars([t for pair in pairs for t in pair], "documents")
        if info.task == "classify":
            if info.size != 1:
                raise invalid(
                    "model",
                    f"{endpoint} needs a cross-encoder with one label; this classifier has "
                    f"{info.size} ({', '.join(info.labels)})",
                )
            messages = [
                self.message(q, protocol.PoolingParams(task="classify", text_pair=d))
                for q, d in pairs
            ]
            # the sigmoid, in a form that never overflows
            return [0.5 * (1.0 + math.tanh(float(x[0]) / 2)) for x in await self.pool(messages)]
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # a query once
        vectors = await self.pool([self.message(t, protocol.PoolingParams()) for t in texts])
        by_text = dict(zip(texts, vectors, strict=True))
        return [_cosine(by_text[a], by_text[b]) for a, b in pairs]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.dot(a, b) / norms) if norms else 0.0


class Embeddings(Pooling):
    async def create(self, body: EmbeddingRequest) -> dict:
        self.check_model(body.model)
        self.served_for(
            "/v1/embeddings",
            "embed",
            "/v1/embeddings needs an embedding model; this one is a classifier (--convert "
            "classify): use /rerank or /score, or serve it with --convert embed",
        )
        params = protocol.PoolingParams(task="embed", dimensions=body.dimensions)
        vectors = await self.pool_inputs(body.inputs(), params)
        data = []
        for index, vector in enumerate(vectors):
            if body.encoding_format == "base64":
                embedding = base64.b64encode(vector.astype("<f4").tobytes()).decode()
            else:
                embedding = vector.tolist()
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        return self.listed("embd", data)


class Rerank(Pooling):
    async def create(self, body: RerankRequest) -> dict:
        self.check_model(body.model)
        documents = body.texts()
        scores = await self.scores("/rerank", [(body.query, d) for d in documents])
        order = sorted(range(len(documents)), key=lambda i: -scores[i])
        if body.top_n:
            order = order[: body.top_n]
        results = []
        for i in order:
            result = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                result["document"] = {"text": documents[i]}
            results.append(result)
        return {
            "id": f"rerank-{self.ring_client.new_uid()}",
            "model": self.model_name,
            "usage": {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens},
            "results": results,
        }


class Score(Pooling):
    async def create(self, body: ScoreRequest) -> dict:
        self.check_model(body.model)
        try:
            pairs = body.pairs()
        except ValueError as exc:
            raise invalid("text_1", str(exc)) from None
        scores = await self.scores("/score", pairs)
        return self.listed(
            "score", [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        )


class Classify(Pooling):
    async def create(self, body: ClassifyRequest) -> dict:
        self.check_model(body.model)
        info = self.served_for(
            "/classify",
            "classify",
            "/classify needs a classification model (a sequence-classification head, "
            "--convert classify); this one serves embeddings (--convert embed): use "
            "/v1/embeddings",
        )
        logits = await self.pool_inputs(body.inputs(), protocol.PoolingParams(task="classify"))
        labels = info.labels or [f"LABEL_{i}" for i in range(info.size)]
        data = []
        for index, row in enumerate(logits):
            probs = _probabilities(row.astype(np.float64), info.problem_type)
            data.append(
                {
                    "index": index,
                    "label": labels[int(np.argmax(probs))],
                    "probs": probs.tolist(),
                    "num_classes": len(probs),
                }
            )
        return self.listed("classify", data, completion_tokens=0)


def _probabilities(logits: np.ndarray, problem_type: str) -> np.ndarray:
    """transformers' reading of a classifier's logits: a softmax over single-label classes,
    each label's own sigmoid for one label or several that may hold at once, the values
    themselves for a regression head."""
    if problem_type == "regression":
        return logits
    if len(logits) == 1 or problem_type == "multi_label_classification":
        return 0.5 * (1.0 + np.tanh(logits / 2))  # the sigmoid, never overflowing
    shifted = np.exp(logits - logits.max())
    return shifted / shifted.sum()
