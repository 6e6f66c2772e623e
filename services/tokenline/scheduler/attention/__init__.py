"""Attention behind one interface (``base.py``), one module per way of computing it.

``choose`` picks the runner's backend once, at start, by name:

- ``flex`` (``flex.FlexAttentionBackend``): paged attention read in place by torch's
  flex_attention, with a block mask built from the block tables. The default on CUDA.
- ``sdpa`` (``sdpa.SdpaBackend``): paged SDPA; decode tokens gather their contexts from the
  pool (``decode.GatherDecode``).
- ``dense-cpu`` (``sdpa.DenseCpuBackend``): the same, but decode tokens read dense per-sequence
  copies of their contexts (``decode.DenseDecode``, ``decode_contexts.py``). The default on
  CPU.
Both SDPA backends route prefill the same way (``prefill.py``): the chunks that start a
prompt as one padded causal batch, each chunk that continues one over its context in the pool.
A new kernel is one ``AttentionBackend`` subclass (or one ``AttentionPath`` swapped into
``SdpaBackend``) and one line in ``BACKENDS``.
"""

from __future__ import annotations

import torch

from tokenline.scheduler.attention.base import (
    AttentionBackend,
    AttentionLayer,
    AttentionPath,
    AttentionShape,
)
from tokenline.scheduler.attention.flex import FlexAttentionBackend
from tokenline.scheduler.attention.sdpa import DenseCpuBackend, SdpaBackend

BACKENDS: dict[str, type[AttentionBackend]] = {
    backend.name: backend for backend in (SdpaBackend, DenseCpuBackend, FlexAttentionBackend)
}


def backend_name(requested: str, device: torch.device, dense_decode: bool = True) -> str:
    """``auto``: flex on CUDA; on CPU the dense decode rows (unless turned off), else SDPA."""
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "flex"
    return "dense-cpu" if dense_decode else "sdpa"


def choose(name: str, shape: AttentionShape, kv_cache: torch.Tensor) -> AttentionBackend:
    """The backend called ``name``, over this KV pool."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; use one of {sorted(BACKENDS)}")
    return BACKENDS[name](shape, kv_cache)


__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionLayer",
    "AttentionPath",
    "AttentionShape",
    "backend_name",
    "choose",
]
