"""What the decoder's pooling engine (engine.py) and the encoder's (encoder_engine.py) do alike:
refuse a request the served model cannot pool, end a request early (abort, deadline) with a
terminal reply that leaves with the next step, and turn a pooled row into the wire's bytes.
Each engine keeps its requests its own way (a batch policy over the KV cache, or a plain queue)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from tokenline.protocol import PoolingParams, Reply
from tokenline.scheduler.engine import DEADLINE_MARGIN_S
from tokenline.scheduler.pooling.config import PoolingSetup
from tokenline.scheduler.refusals import InvalidRequest


class WrongRunner(InvalidRequest):
    """A request of the other kind: generation on a pooling model, or the reverse task."""

    code = "invalid_request_error"
    param = "model"


@dataclass
class PoolingRequest:
    """A request that passed the checks every pooling engine makes."""

    uid: str
    ids: list[int]
    types: list[int] | None  # an encoder's segments; decoders read none
    params: PoolingParams
    deadline: float
    arrival: float
    tokenizer_s: float


class _Held(Protocol):
    """A request as an engine holds it: when it arrived and when it must have ended."""

    arrival: float
    deadline: float


class PoolingEngineBase:
    """Admission checks and early ends for a pooling engine whose subclass says how it
    admits (`_admit`), forgets (`_forget`) and lists (`_held`) its requests."""

    def __init__(self, setup: PoolingSetup) -> None:
        self.setup = setup
        self._finished: list[Reply] = []  # ends not tied to a forward pass (aborts)
        self.step_uids: list[str] = []

    @property
    def size(self) -> int:
        """An embedding's length, or the classifier's number of labels."""
        raise NotImplementedError

    def _admit(self, request: PoolingRequest) -> Any:
        """Hold a checked request, or refuse it (`InvalidRequest`) where it can never run."""
        raise NotImplementedError

    def _forget(self, uid: str) -> _Held | None:
        """Let go of ``uid``: the request it was, or None where it was not held."""
        raise NotImplementedError

    def _held(self) -> Mapping[str, _Held]:
        """Every request held (waiting, running or paused), by uid."""
        raise NotImplementedError

    # ── requests ───────────────────────────────────────────────────────────────────────────────
    def add(
        self,
        uid: str,
        prompt_ids: list[int],
        params: PoolingParams,
        timeout_s: float = float("inf"),
        arrival: float | None = None,
        tokenizer_s: float = 0.0,
        token_type_ids: list[int] | None = None,
    ) -> Any:
        check_params(params, self.setup, self.size)
        if not prompt_ids:  # the tokenizer stage refuses these: a caller that skipped it
            raise ValueError(f"{uid}: an empty prompt; pooling needs at least one token")
        now = time.monotonic()
        arrived = now if arrival is None else arrival
        ids = list(prompt_ids)
        request = PoolingRequest(
            uid, ids, token_type_ids, params, now + timeout_s, arrived, tokenizer_s
        )
        return self._admit(request)

    def abort(self, uid: str, finish_reason: str = "abort") -> bool:
        """End ``uid`` now (a KV cache's blocks back at once); its terminal reply leaves with
        the next step."""
        request = self._forget(uid)
        if request is None:
            return False
        reply = Reply(uid=uid, text="", num_tokens=0, finish_reason=finish_reason)
        reply.scheduler_s = time.monotonic() - request.arrival
        self._finished.append(reply)
        return True

    def drop(self, uid: str) -> bool:
        """Forget ``uid`` without a reply (the caller reports its end)."""
        return self._forget(uid) is not None

    def holds(self, uid: str) -> bool:
        return uid in self._held()

    def held_uids(self) -> list[str]:
        return list(self._held())

    def expire(self, now: float | None = None) -> list[str]:
        """Abort requests past their deadline plus a margin (the api's backstop, as in
        `Engine.expire`)."""
        now = time.monotonic() if now is None else now
        late = [u for u, r in self._held().items() if now > r.deadline + DEADLINE_MARGIN_S]
        for uid in late:
            self.abort(uid)
        return late

    def _pooled_reply(
        self,
        request: PoolingRequest,
        result: torch.Tensor,
        started: float,
        now: float,
        cached_tokens: int = 0,
    ) -> Reply:
        """A pooled request's terminal reply: its row as the wire carries it (an embedding
        finished as the request asks, or the classifier's scores as they are), and its times:
        queued until ``started``, in the scheduler until ``now``."""
        params = request.params
        if self.setup.task == "embed":
            data = finish_embedding(result, params.dimensions, self.setup.normalize)
        else:
            data = result.to(torch.float32).numpy().astype("<f4").tobytes()
        return Reply(
            uid=request.uid,
            text="",
            num_tokens=0,
            finish_reason="stop",
            prompt_tokens=len(request.ids),
            tokenizer_s=request.tokenizer_s,
            queue_s=started - request.arrival,
            scheduler_s=now - request.arrival,
            cached_tokens=cached_tokens,
            pooled=data,
        )


def finish_embedding(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> bytes:
    """An embedding as the wire carries it: cut to ``dimensions`` (Matryoshka) and then
    normalised when the model asks (vLLM's order), float32 little-endian."""
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        vector = F.normalize(vector, dim=-1)
    return vector.to(torch.float32).numpy().astype("<f4").tobytes()


def check_params(params: PoolingParams | None, setup: PoolingSetup, size: int) -> None:
    """Refuse a request this pooling model cannot serve, naming the mismatch."""
    if params is None:
        raise WrongRunner(
            "this model is served with --runner pooling (embeddings, rerank, score, classify): "
            "it generates no text; use /v1/embeddings, /rerank, /score or /classify, or serve a "
            "generative model for chat and completions"
        )
    if params.task != setup.task:
        served = "embeddings (/v1/embeddings)" if setup.task == "embed" else "scores"
        raise WrongRunner(
            f"this model serves {served} (--convert {setup.task}), not {params.task} requests"
        )
    dims = params.dimensions
    if dims is None:
        return
    if setup.matryoshka == [] or not 1 <= dims <= size:
        allowed = (
            "this model was not trained for shorter embeddings (no Matryoshka dimensions in "
            "its config); leave dimensions out"
            if setup.matryoshka == []
            else f"ask for 1 to {size}"
        )
        raise InvalidRequest(f"dimensions {dims}: {allowed}", param="dimensions")
    if setup.matryoshka and dims not in setup.matryoshka:
        raise InvalidRequest(
            f"dimensions {dims}: this model serves {setup.matryoshka}", param="dimensions"
        )
