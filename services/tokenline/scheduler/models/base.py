"""What the runner calls on a model, whichever path runs it (`CausalLM`), and what it reads of
its attention to size the KV pool and choose the attention backend (`Geometry`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from tokenline.scheduler.attention import AttentionLayer
from tokenline.scheduler.layers.context import ForwardContext
from tokenline.scheduler.layers.linear import CACHE_SIZED_WEIGHTS, weight_bytes
from tokenline.scheduler.layers.placement import ModelRefused, Placement
from tokenline.scheduler.layers.rotary import Rotary


@dataclass(frozen=True)
class Geometry:
    """This rank's attention: its heads, and every layer as the attention backend sees it."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    layers: tuple[AttentionLayer, ...]
    windows: tuple[int | None, ...]  # each layer's sliding window; None: the whole context

    @property
    def window(self) -> int | None:
        """The model's one sliding window (every sliding layer's), if any layer slides."""
        found = {w for w in self.windows if w}
        if len(found) > 1:
            raise ModelRefused(
                f"its layers slide over different windows ({sorted(found)}); tokenline serves "
                "one window per model"
            )
        return next(iter(found), None)


class CausalLM(torch.nn.Module):
    """A decoder that turns a flat batch of token rows into hidden states and logits.

    ``forward`` runs every token row of a step (many sequences, each row at its own position;
    attention keeps the sequences apart) and returns the final hidden states (after the last
    norm) of ``rows`` only; ``logits`` turns such hidden states into float32 logits over the
    whole vocabulary.
    """

    #: which path runs it: "tokenline" (a native module) or "transformers" (their modules)
    implementation: ClassVar[str] = "tokenline"
    #: the config.json ``model_type`` a native module computes: transformers chooses a model's
    #: code by it, not by ``architectures``, so a checkpoint naming this class over another
    #: model_type (Granite, Mistral's window...) is that other model
    model_type: ClassVar[str] = ""

    def __init__(self, config, place: Placement) -> None:
        super().__init__()
        self.config = config
        self.place = place
        self.architecture = (getattr(config, "architectures", None) or [type(self).__name__])[0]
        # a multimodal checkpoint keeps its decoder's sizes in its text config
        self.text_config = config.get_text_config()
        self.vocab_size = int(self.text_config.vocab_size)

    geometry: Geometry

    # EAGLE-3 (speculative/eagle3.py): a family whose forward can keep the residual stream
    # entering some layers sets ``captures_aux``; while ``aux_layers`` names layers, its
    # forward leaves every row's states of them, side by side in layer order, in
    # ``aux_hidden``. Empty (the default): nothing is kept, the forward runs as ever.
    captures_aux: ClassVar[bool] = False
    aux_layers: tuple[int, ...] = ()
    aux_hidden: torch.Tensor | None = None

    @property
    def lora_dims(self) -> dict[str, tuple[int, int]]:
        """The linears a LoRA adapter may target, by PEFT's names: (in, out) features. Empty:
        this model takes no adapters."""
        return {}

    def forward(
        self, input_ids: torch.Tensor, context: ForwardContext, rows: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compile_layers(self) -> bool:
        """Compile what the family can (``--compile``); False: it runs eagerly."""
        return False

    def pack_weights(self) -> None:
        """Repack the projections' and experts' weights for the CPU's GEMMs (layers/linear.py
        `Packable`, layers/moe.py `Experts`),
        once every weight is loaded. A model whose weights fit the caches keeps the plain
        ones too, for single rows."""
        keep_plain = weight_bytes(self) < CACHE_SIZED_WEIGHTS
        in_graph = {id(m) for m in self.graph_modules()}
        for module in self.modules():
            if module is self or id(module) in in_graph:
                continue
            if hasattr(module, "pack_weights"):  # Packable, Experts
                module.pack_weights(keep_plain)

    def graph_modules(self) -> list[torch.nn.Module]:
        """The modules inside a graph compiled with frozen weights (``--compile`` on CPU),
        whose plain weights inductor packs itself."""
        return []

    def graph_refusal(self) -> str:
        """Why a decode step of this model cannot be replayed over fixed buffers (a CUDA
        graph): "" when it can. Native modules can unless a rotary table changes with the
        step's positions."""
        rotaries = [v for v in vars(self).values() if isinstance(v, Rotary)]
        rotaries += [r for v in vars(self).values() if isinstance(v, dict) for r in v.values()]
        if any(not r.static for r in rotaries if isinstance(r, Rotary)):
            return "its rotary embedding changes with each step's longest position"
        return ""

    def describe(self) -> str:
        return f"{self.architecture} ({self.implementation})"
