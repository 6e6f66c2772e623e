"""The proposer a ``--speculative-config`` asks for."""

from __future__ import annotations

from tokenline.scheduler.runner import ModelRunner
from tokenline.scheduler.speculative.config import SpeculativeConfig
from tokenline.scheduler.speculative.draft import draft_proposer
from tokenline.scheduler.speculative.eagle3 import eagle3_proposer
from tokenline.scheduler.speculative.ngram import NgramProposer
from tokenline.scheduler.speculative.proposals import Proposer


def proposer_for(config: SpeculativeConfig | None, target: ModelRunner) -> Proposer | None:
    """None without speculation; a draft model or an EAGLE-3 head runs beside ``target``, on
    its device."""
    if config is None:
        return None
    if config.method == "draft_model":
        return draft_proposer(config, target)
    if config.method == "eagle3":
        return eagle3_proposer(config, target)
    return NgramProposer(
        config.num_speculative_tokens,
        config.prompt_lookup_min,
        config.prompt_lookup_max,
        config.disable_by_batch_size,
    )
