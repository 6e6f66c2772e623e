"""Loading a rank's shard straight from the checkpoint's safetensors files.

The model is built on the meta device from a config whose sizes are the rank's shard (see
``shard.sharded_config``), so no process ever holds the whole model: each parameter is then
read as its slice (``safe_open(...).get_slice(name)[index]`` reads only those bytes) and
assigned in place of the meta tensor. Buffers computed at construction (the rotary tables) are
rebuilt on the device from the config.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from tokenline.model_source import ModelSource
from tokenline.scheduler.parallel.shard import ShardPlan, sharded_config, slice_of

log = logging.getLogger(__name__)


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
        raise SystemExit(f"{source.spec}: tensor parallelism loads safetensors checkpoints only")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _read(files: dict[str, Path], name: str, plan: ShardPlan) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(files[name], framework="pt") as f:
        part = f.get_slice(name)
        index = slice_of(name, plan, tuple(part.get_shape()))
        return part[index] if index is not None else part[:]


def load_sharded_model(
    source: ModelSource, plan: ShardPlan, dtype: torch.dtype, device: torch.device
) -> torch.nn.Module:
    """The model with this rank's shard of every weight, on ``device``."""
    from transformers import AutoModelForCausalLM

    config = sharded_config(source.load_config(), plan)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    files = checkpoint_files(source)
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = "lm_head.weight" in params and "lm_head.weight" not in files
    for name, param in params.items():
        if tied and name == "lm_head.weight":
            continue
        if name not in files:
            raise SystemExit(f"{source.spec}: {name} is not in the checkpoint")
        tensor = _read(files, name, plan).to(dtype)
        if tensor.shape != param.shape:  # vocabulary padding, or a bias added once
            tensor = _fit(name, tensor, param.shape, plan)
        _assign(model, name, torch.nn.Parameter(tensor.to(device), requires_grad=False))
    if tied:  # the LM head is the embedding: the same rows of the vocabulary
        model.lm_head.weight = model.get_input_embeddings().weight
    _rebuild_buffers(model, config, device)
    model.eval()
    log.info("rank %d: loaded its shard of %s", plan.rank, source.spec)
    return model


def _fit(name: str, tensor: torch.Tensor, shape: torch.Size, plan: ShardPlan) -> torch.Tensor:
    if name.endswith("bias") and name.split(".")[-2] in ("o_proj", "down_proj"):
        return tensor  # row-parallel bias: whole, added on rank 0 only
    if tensor.shape[1:] == shape[1:] and tensor.shape[0] <= shape[0]:  # the last vocab rows
        padded = torch.zeros(shape, dtype=tensor.dtype)
        padded[: tensor.shape[0]] = tensor
        return padded
    raise SystemExit(f"{name}: shard {tuple(tensor.shape)} does not fit {tuple(shape)}")


def _assign(model: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    owner._parameters[attr] = param


def _rebuild_buffers(model: torch.nn.Module, config, device: torch.device) -> None:
    """Buffers are computed at construction, so on meta they hold nothing: rebuild the modules
    that own them (rotary embeddings) on the device."""
    for module_name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        if not hasattr(module, "rope_type") and "rotary" not in type(module).__name__.lower():
            raise SystemExit(f"{module_name}: cannot rebuild the buffers of {type(module)}")
        with torch.device(device):
            rebuilt = type(module)(config=config)
        parent_name, _, attr = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, rebuilt)
