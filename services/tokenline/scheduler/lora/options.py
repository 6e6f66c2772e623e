"""--enable-lora's sizes, and the adapter bookkeeping an engine builds from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenline.scheduler.lora.adapters import LoraAdapter, load_adapter, local_path
from tokenline.scheduler.lora.slots import LoraSlots
from tokenline.settings import BY_FLAG

if TYPE_CHECKING:
    from tokenline.scheduler.runner import ModelRunner


@dataclass
class LoraOptions:
    """--enable-lora's sizes: device slots, highest rank, adapters kept in host memory."""

    max_loras: int = BY_FLAG["max-loras"].default
    max_rank: int = BY_FLAG["max-lora-rank"].default
    max_cpu_loras: int = BY_FLAG["max-cpu-loras"].default
    cache_dir: str | None = None  # where adapters named by URI are fetched to


def lora_slots(runner: ModelRunner, options: LoraOptions) -> LoraSlots:
    """The adapter bookkeeping over the runner's device slots, reading adapters from disk
    (or fetching them) checked against this model and ``max_rank``."""
    weights = runner.enable_lora(options.max_loras, options.max_rank)

    def load(name: str, uri: str) -> LoraAdapter:
        path = local_path(name, uri, options.cache_dir)
        return load_adapter(name, path, runner.lora_shape, options.max_rank)

    return LoraSlots(options.max_loras, options.max_cpu_loras, load, weights.set_slot)
