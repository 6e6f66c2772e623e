"""Loading a native model's weights from the checkpoint's safetensors files, by the names
transformers gives them.

Each checkpoint tensor is mapped to (module, parameter, shard) by the model
(``checkpoint_target``: q/k/v fold into ``qkv_proj``, gate/up into ``gate_up_proj``, each
expert's projections into its layer's stacked experts), and that module copies its rank's slice
(``safe_open(...).get_slice(name)[index]`` reads only those bytes), so no process ever holds
more than its share. Loading is strict both ways, because a weight left out or ignored is a
model served wrong: a checkpoint tensor no module takes, or a parameter (or a shard of one) no
tensor filled, refuses the model with their names.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from collections.abc import Hashable
from contextlib import ExitStack
from pathlib import Path

import torch

from tokenline.model_source import ModelSource
from tokenline.scheduler.layers.linear import WHOLE
from tokenline.scheduler.layers.placement import ModelRefused

log = logging.getLogger(__name__)

IGNORE = "ignore"  # a checkpoint tensor that computes nothing (a saved rotary table)
_COMPUTED_BUFFERS = re.compile(r"rotary_emb\.(inv_freq|cos_cached|sin_cached)$")
# q/k/v and gate/up are fused: (the fused module, the shard) of each checkpoint name
PACKED: dict[str, tuple[str, Hashable]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

Target = tuple[str, str, Hashable]
HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def packed_target(name: str) -> Target | str:
    """(module, parameter, shard) of a dense layer's checkpoint tensor, or IGNORE."""
    if _COMPUTED_BUFFERS.search(name):
        return IGNORE
    module, _, param = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    if leaf in PACKED:
        fused, shard = PACKED[leaf]
        return f"{parent}.{fused}" if parent else fused, param, shard
    return module, param, WHOLE


class CheckpointTensor:
    """One tensor of a safetensors file, read lazily: ``tensor[index]`` reads that slice."""

    def __init__(self, handle, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def __getitem__(self, index) -> torch.Tensor:
        return self._slice[index]


def checkpoint_files(source: ModelSource) -> dict[str, Path]:
    """Each tensor's safetensors file, from a local directory or the Hugging Face cache."""
    root = Path(source.path)
    if not root.is_dir():
        from huggingface_hub import snapshot_download

        root = Path(
            snapshot_download(
                source.path, revision=source.revision, allow_patterns=["*.json", "*.safetensors"]
            )
        )
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: root / file for name, file in weight_map.items()}
    single = root / "model.safetensors"
    if not single.exists():
        raise ModelRefused(
            f"{source.spec} has no safetensors weights (model.safetensors or its index); native "
            "modules read safetensors only (--model-impl transformers reads other formats)"
        )
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def stores_own_head(source: ModelSource) -> bool:
    """Whether the checkpoint holds an LM head that is not its embedding. transformers keeps
    such a head even where the config ties the two (it warns and does not tie them), so the
    native module must not tie them either."""
    from safetensors import safe_open

    files = checkpoint_files(source)
    if HEAD not in files or EMBEDDING not in files:
        return False
    with ExitStack() as stack:
        head, embedding = (
            stack.enter_context(safe_open(files[name], framework="pt")).get_slice(name)
            for name in (HEAD, EMBEDDING)
        )
        shape = head.get_shape()
        if shape != embedding.get_shape():
            return True
        rows = max(1, (64 << 20) // max(1, 4 * shape[-1]))  # compared a slice at a time
        return any(
            not torch.equal(head[start : start + rows], embedding[start : start + rows])
            for start in range(0, shape[0], rows)
        )


def load_weights(model: torch.nn.Module, source: ModelSource) -> None:
    """Fill every parameter of ``model`` from the checkpoint (``model.checkpoint_target``
    maps names); refuses the model when a tensor or a parameter is left over."""
    from safetensors import safe_open

    files = checkpoint_files(source)
    filled: dict[tuple[str, str], set[Hashable]] = defaultdict(set)
    unexpected: list[str] = []
    with ExitStack() as stack, torch.no_grad():
        handles: dict[Path, object] = {}
        for name in sorted(files):
            if name == HEAD and getattr(model, "tied", False):
                continue  # the embedding, stored twice (`stores_own_head` untied one that differs)
            target = model.checkpoint_target(name)
            if target == IGNORE:
                continue
            module_name, param, shard = target
            try:
                module = model.get_submodule(module_name)
            except AttributeError:
                module = None
            if module is None or getattr(module, "_parameters", {}).get(param) is None:
                unexpected.append(name)
                continue
            path = files[name]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(path, framework="pt"))
            try:
                filled[(module_name, param)] |= module.load_weight(
                    param, shard, CheckpointTensor(handles[path], name)
                )
            except ModelRefused as exc:
                raise ModelRefused(f"{source.spec}: {name}: {exc}") from None
    missing = []
    for module_name, module in model.named_modules():
        for param, value in module._parameters.items():
            if value is None:
                continue
            left = module.shards(param) - filled[(module_name, param)]
            if left:
                shown = "" if left == {WHOLE} else f" (shards {sorted(left, key=str)[:4]})"
                missing.append(f"{module_name}.{param}{shown}")
    if unexpected or missing:
        problems = []
        if unexpected:
            problems.append(f"tensors it does not compute with: {_few(unexpected)}")
        if missing:
            problems.append(f"weights the checkpoint lacks: {_few(missing)}")
        raise ModelRefused(
            f"{source.spec}: the checkpoint does not match {model.architecture}'s native module; "
            + "; ".join(problems)
        )
    log.info("loaded %d tensors of %s", len(files), source.spec)


def _few(names: list[str]) -> str:
    shown = ", ".join(names[:5])
    return shown if len(names) <= 5 else f"{shown} and {len(names) - 5} more"
