"""The target's embedding and LM head over its whole vocabulary, for an EAGLE-3 head beside a
tensor-parallel target.

Under tensor parallelism each rank holds a slice of the vocabulary rows and looks tokens up, or
gathers logits, with a collective every rank must join; only rank 0 runs the head, so it cannot
borrow the target's modules there. Rank 0 reads whole copies of the tensors the head borrows
from the target's checkpoint instead (vocabulary x hidden each, in the target's dtype).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenline.scheduler.models.weights import checkpoint_files

log = logging.getLogger(__name__)

Lookup = Callable[[torch.Tensor], torch.Tensor]


class MissingVocabulary(ValueError):
    """The checkpoint has no single tensor of that name; the message names what was sought."""


def whole_vocabulary(target, *, embed: bool, lm_head: bool) -> tuple[Lookup | None, Lookup | None]:
    """The embedding (token ids to hidden states) and the LM head (hidden states to logits)
    of ``target`` (a sharded `ModelRunner`) over its whole vocabulary, each only if asked."""
    files = checkpoint_files(target.source)
    model = target.model
    tied = getattr(model.lm_head, "tied", None) is not None
    embedding = None
    if embed or (lm_head and tied):
        embedding = _read(files, "embed_tokens.weight", target)
    head = None
    if lm_head:
        head = embedding if tied else _read(files, "lm_head.weight", target)
    copies = [t for t in (embedding, head) if t is not None]
    log.info(
        "speculative decoding with EAGLE-3 at tensor parallelism %d: rank 0 holds the "
        "target's whole vocabulary for the head (%.2f GiB)",
        target.tp.world_size,
        sum(t.numel() * t.element_size() for t in {id(t): t for t in copies}.values()) / 2**30,
    )
    scale = getattr(model.model.embed_tokens, "scale", None)

    def lookup(ids: torch.Tensor) -> torch.Tensor:
        hidden = F.embedding(ids, embedding)
        return hidden if scale is None else hidden * scale

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, head)

    return (lookup if embed else None), (logits if lm_head else None)


def _read(files: dict[str, Path], suffix: str, target) -> torch.Tensor:
    names = [name for name in files if name == suffix or name.endswith("." + suffix)]
    if len(names) != 1:
        raise MissingVocabulary(
            f"the target's checkpoint has {len(names)} tensors named *{suffix} "
            f"({', '.join(names[:3]) or 'none'}), and the head needs exactly one"
        )
    from safetensors import safe_open

    with safe_open(files[names[0]], framework="pt") as handle:
        tensor = handle.get_tensor(names[0])
    return tensor.to(device=target.device, dtype=target.dtype)
