"""The model families tokenline serves, and which path runs a checkpoint.

Two paths (``--model-impl``, vLLM's ``--model-impl`` with ``tokenline`` for ``vllm``):

- ``tokenline``: a native module of ours (one file per family, over ``scheduler/layers``),
  weights loaded from safetensors by transformers' names (``weights.py``); tensor parallelism
  and LoRA work here.
- ``transformers``: transformers' own modules with tokenline's paged attention (``generic.py``);
  any decoder whose layers all attend through transformers' attention interface, checked at
  start to compute each sequence of a batch as the model does alone. Slower, one device, no
  LoRA, but exact.

``auto`` (the default) takes the native module when the architecture has one and the config (its
``model_type`` too: transformers picks a model's code by it) and checkpoint fit it, else
transformers' modules. A model neither path runs exactly is refused at
start (`ModelRefused`), with the architecture and what would be needed: never half-loaded, never
served wrong.
"""

from __future__ import annotations

import logging

from tokenline.model_source import ModelSource
from tokenline.scheduler.layers.placement import ModelRefused, Placement
from tokenline.scheduler.models.base import CausalLM, Geometry
from tokenline.scheduler.models.gemma3 import Gemma3ForCausalLM
from tokenline.scheduler.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from tokenline.scheduler.models.mixtral import MixtralForCausalLM
from tokenline.scheduler.models.qwen3_moe import Qwen3MoeForCausalLM
from tokenline.scheduler.models.weights import load_weights, stores_own_head

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("auto", "tokenline", "transformers")
NATIVE: dict[str, type[CausalLM]] = {
    cls.__name__: cls
    for cls in (
        LlamaForCausalLM,
        MistralForCausalLM,
        Qwen2ForCausalLM,
        Qwen3ForCausalLM,
        Qwen3MoeForCausalLM,
        MixtralForCausalLM,
        Gemma3ForCausalLM,
    )
}


def architecture_of(config) -> str:
    return (getattr(config, "architectures", None) or ["(no architectures in config.json)"])[0]


def load(source: ModelSource, implementation: str, place: Placement) -> CausalLM:
    """The checkpoint at ``source`` as a model on ``place``, by the path ``implementation``
    asks for; `ModelRefused` says why neither path can run it."""
    if implementation not in IMPLEMENTATIONS:
        raise ModelRefused(f"--model-impl {implementation!r}: use one of {IMPLEMENTATIONS}")
    try:
        config = source.load_config()
    except (ValueError, KeyError, OSError) as exc:
        raise ModelRefused(f"transformers cannot read its config.json: {exc}") from None
    architecture = architecture_of(config)
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = (quantization or {}).get("quant_method", "unknown")
        raise ModelRefused(
            f"{architecture}: quantized checkpoints ({method}) are not served yet; serve the "
            "unquantized weights"
        )
    native = NATIVE.get(architecture)
    if implementation == "tokenline" and native is None:
        raise ModelRefused(
            f"{architecture} has no native module (native: {', '.join(sorted(NATIVE))}); "
            "--model-impl transformers runs it on transformers' modules"
        )
    refused = ""
    if native is not None and implementation != "transformers":
        try:
            if config.model_type != native.model_type:
                raise ModelRefused(
                    f"config.json's model_type is {config.model_type!r}, which transformers "
                    f"runs as its own model, not as {architecture} ({native.model_type!r})"
                )
            if getattr(config, "tie_word_embeddings", False) and stores_own_head(source):
                log.warning(
                    "%s: tie_word_embeddings is set but lm_head.weight differs from the "
                    "embedding: the stored head is used, as transformers does",
                    source.spec,
                )
                config.tie_word_embeddings = False
            model = native(config, place)
            load_weights(model, source)
            return model
        except ModelRefused as exc:
            if implementation == "tokenline":
                raise ModelRefused(f"{architecture}: {exc}") from None
            refused = f"its native module refused it ({exc}); "
            log.warning("%s: %strying transformers' modules", source.spec, refused)
    from tokenline.scheduler.models.generic import TransformersCausalLM

    try:
        return TransformersCausalLM(source, config, place)
    except ModelRefused as exc:
        raise ModelRefused(f"{architecture}: {refused}transformers' modules: {exc}") from None


__all__ = ["IMPLEMENTATIONS", "NATIVE", "CausalLM", "Geometry", "ModelRefused", "load"]
