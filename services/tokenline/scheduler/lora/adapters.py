"""PEFT LoRA adapters read from disk into host tensors, validated against the base model.

A PEFT adapter directory holds ``adapter_config.json`` (rank ``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``...) and ``adapter_model.safetensors`` with, per targeted
linear, ``...layers.{i}.{self_attn|mlp}.{module}.lora_A.weight`` ``[r, in]`` and
``...lora_B.weight`` ``[out, r]``. PEFT adds ``lora_B(lora_A(x)) * scaling`` to the linear's
output, with ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` under rslora).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

# The linears an adapter may target, by PEFT's module names, and the block holding each.
SUPPORTED_MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[^.]+)?\.weight$")
_EXPERTS = re.compile(r"\.(mlp|block_sparse_moe)\.experts\.")


class LoraError(Exception):
    """An adapter that cannot be served; ``code`` and ``http_status`` as vLLM answers."""

    def __init__(self, message: str, code: str = "invalid_request_error", status: int = 400):
        super().__init__(message)
        self.code = code
        self.http_status = status


class AdapterNotFound(LoraError):
    def __init__(self, message: str) -> None:
        super().__init__(message, code="model_not_found", status=404)


@dataclass
class LoraAdapter:
    """One adapter in host memory: per (layer, module), ``A`` ``[r, in]`` and ``B`` ``[out, r]``
    in float32, and the scale PEFT multiplies their product by."""

    name: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def modules(self) -> set[str]:
        return {module for _, module in self.weights}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


@dataclass(frozen=True)
class ModelShape:
    """What an adapter must fit: the base model's layers and each linear's (in, out)."""

    num_layers: int
    dims: dict[str, tuple[int, int]]  # module name → (in features, out features)

    @classmethod
    def of(cls, layers: list[torch.nn.Module]) -> ModelShape:
        dims = {}
        for module, block in SUPPORTED_MODULES.items():
            linear = getattr(getattr(layers[0], block, None), module, None)
            if isinstance(linear, torch.nn.Linear):
                dims[module] = (linear.in_features, linear.out_features)
        return cls(len(layers), dims)


def local_path(name: str, uri: str, cache_dir: str | None = None) -> Path:
    """A local directory holding the adapter at ``uri``: a directory as is, any URI that
    ``--model`` takes fetched once into the cache (tokenline/fetch)."""
    if "://" in uri:
        from tokenline.fetch import FetchError, cache_name, fetch, parse_uri, redact
        from tokenline.model_source import DEFAULT_CACHE_DIR

        try:
            root = Path(cache_dir or DEFAULT_CACHE_DIR) / "loras"
            return Path(fetch(uri, root / cache_name(parse_uri(uri))).path)
        except FetchError as exc:
            raise AdapterNotFound(f"LoRA adapter {name!r}: {redact(uri)}: {exc}") from exc
    path = Path(uri)
    if not path.is_dir():
        raise AdapterNotFound(f"LoRA adapter {name!r}: no directory at {uri!r}")
    return path


def load_adapter(name: str, path: Path, shape: ModelShape, max_rank: int) -> LoraAdapter:
    """Read and check a PEFT LoRA adapter directory; `LoraError` says what is wrong."""
    config_file = path / "adapter_config.json"
    if not config_file.exists():
        raise AdapterNotFound(f"LoRA adapter {name!r}: {path} has no adapter_config.json")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise LoraError(f"LoRA adapter {name!r}: adapter_config.json: {exc}") from exc
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraError(f"LoRA adapter {name!r}: peft_type {peft_type} is not LORA")
    rank = int(config.get("r", 0))
    if not 0 < rank <= max_rank:
        raise LoraError(
            f"LoRA rank {rank} of adapter {name!r} is greater than max_lora_rank {max_rank}"
            if rank > max_rank
            else f"LoRA adapter {name!r}: rank {rank} is not positive"
        )
    # What tokenline does not apply: refused rather than served wrong.
    for key, plain in (("use_dora", False), ("modules_to_save", None), ("bias", "none")):
        if config.get(key, plain) not in (plain, [], False, None):
            raise LoraError(f"LoRA adapter {name!r}: {key}={config[key]!r} is not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoraError(f"LoRA adapter {name!r}: per-module rank_pattern/alpha_pattern")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.exists():
        raise LoraError(f"LoRA adapter {name!r}: {path} has no adapter_model.safetensors")
    from safetensors.torch import load_file

    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    for key, tensor in load_file(str(weights_file)).items():
        match = _KEY.search(key)
        if match is None and _EXPERTS.search(key):
            raise LoraError(
                f"LoRA adapter {name!r} targets the experts of a mixture-of-experts layer "
                f"({key}); adapters apply to an MoE model's attention projections only"
            )
        if match is None:
            raise LoraError(f"LoRA adapter {name!r}: unexpected weight {key}")
        layer, block, module, half = int(match[1]), match[2], match[3], match[4]
        if SUPPORTED_MODULES.get(module) != block or module not in shape.dims:
            raise LoraError(
                f"LoRA adapter {name!r} targets {block}.{module}; supported: {sorted(shape.dims)}"
            )
        if not 0 <= layer < shape.num_layers:
            raise LoraError(f"LoRA adapter {name!r}: layer {layer} is not in the base model")
        halves[(layer, module, half)] = tensor.float()
    weights = {}
    for (layer, module, half), a in halves.items():
        if half != "A":
            continue
        b = halves.get((layer, module, "B"))
        fan_in, fan_out = shape.dims[module]
        if b is None or a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise LoraError(
                f"LoRA adapter {name!r}: layer {layer} {module}: expected A [{rank}, {fan_in}] "
                f"and B [{fan_out}, {rank}], got {tuple(a.shape)} and "
                f"{None if b is None else tuple(b.shape)}"
            )
        weights[(layer, module)] = (a, b)
    if not weights:
        raise LoraError(f"LoRA adapter {name!r}: no LoRA weights in {weights_file}")
    return LoraAdapter(name, rank, scaling, weights)
