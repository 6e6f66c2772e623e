"""Decoders that pool: a native family's module (models/) without its LM head, or with a
sequence-classification head (``score``) in its place, run by the same runner (paged KV,
chunked prefill, every attention backend) as a generating model.

The checkpoint may be a causal LM (its LM head is not loaded), a headless model as
sentence-transformers saves one (``Qwen3Model``: names without the ``model.`` prefix) or a
``*ForSequenceClassification`` (``model.*`` and ``score.weight``). ``logits`` is the head: the
hidden state itself (float32) for embeddings, the classifier's logits for classification.
"""

from __future__ import annotations

import torch

from tokenline.model_source import ModelSource
from tokenline.scheduler.layers.linear import Linear
from tokenline.scheduler.layers.placement import ModelRefused, Placement
from tokenline.scheduler.models import NATIVE, CausalLM
from tokenline.scheduler.models.weights import IGNORE, Target, load_weights
from tokenline.scheduler.pooling.config import CLASSIFY_SUFFIX, HEADLESS_SUFFIX, PoolingSetup
from tokenline.scheduler.runner import ModelRunner, RunnerOptions

_SUFFIXES = (CLASSIFY_SUFFIX, "ForCausalLM", HEADLESS_SUFFIX)


def native_family(architecture: str) -> type[CausalLM] | None:
    """The native causal-LM module of ``architecture``'s family (Qwen3Model → Qwen3ForCausalLM)."""
    for suffix in _SUFFIXES:
        if architecture.endswith(suffix):
            return NATIVE.get(architecture.removesuffix(suffix) + "ForCausalLM")
    return None


def pooling_model(family: type[CausalLM], config, place: Placement, task: str) -> CausalLM:
    """``family``'s module with the head ``task`` needs instead of its LM head."""

    class PoolingDecoder(family):
        def __init__(self) -> None:
            super().__init__(config, place)
            del self.lm_head  # nothing computes over the vocabulary
            self.tied = False
            self.score = None
            if task == "classify":
                labels = int(getattr(config, "num_labels", 0) or 1)
                self.score = Linear(config.hidden_size, labels, False, place)

        def logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return (hidden if self.score is None else self.score(hidden)).float()

        def checkpoint_target(self, name: str) -> Target | str:
            if name.startswith("lm_head."):
                return IGNORE
            if name.startswith("score."):
                if self.score is None:
                    return IGNORE  # a classifier served for its embeddings
                return super().checkpoint_target(name)
            if not name.startswith("model."):  # saved headless: Qwen3Model's own names
                name = "model." + name
            return super().checkpoint_target(name)

        @property
        def lora_dims(self) -> dict[str, tuple[int, int]]:
            return {}

    PoolingDecoder.__name__ = PoolingDecoder.__qualname__ = f"Pooling{family.__name__}"
    return PoolingDecoder()


class PoolingRunner(ModelRunner):
    """The model runner over a pooling decoder: the same pool, batches and attention; its
    ``logits`` are the pooling head's."""

    def __init__(self, source: ModelSource, options: RunnerOptions, setup: PoolingSetup) -> None:
        self.setup = setup
        super().__init__(source, options)

    def _load_model(self, source: ModelSource, implementation: str) -> CausalLM:
        config = source.load_config()
        family = native_family(self.setup.architecture)
        served = ", ".join(sorted(n.removesuffix("ForCausalLM") for n in NATIVE))
        if family is None or implementation == "transformers":
            raise ModelRefused(
                f"{self.setup.architecture}: pooling runs decoders of the native families "
                f"({served}) on their native modules; this one has none"
            )
        model = pooling_model(family, config, Placement(self.device, self.dtype), self.setup.task)
        load_weights(model, source)
        return model
