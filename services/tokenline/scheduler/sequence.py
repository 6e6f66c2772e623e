"""One request's state inside the scheduler."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokenline.protocol import SamplingParams
from tokenline.reasoning import ReasoningSplit


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PAUSED = "paused"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    uid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    deadline: float = float("inf")
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    # Prefix caching (kv_cache.py): names of the full blocks of the known tokens, as far as
    # they were needed; how many leading blocks of block_table the cache has already seen;
    # prompt tokens served from the cache at the first admission (None: not admitted yet).
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    cached_tokens: int | None = None
    status: Status = Status.WAITING
    first_scheduled: float | None = None
    generator: object | None = None  # torch.Generator for seeded sampling, made by the runner
    matcher: object | None = None  # llguidance.LLMatcher when the output follows a grammar
    # with a matcher and a reasoning parser: where the thinking ends, and the grammar starts
    reasoning: ReasoningSplit | None = None
    # sampling.prompt_logprobs: the prompt tokens' entries gathered so far ([0] is None), up
    # to the first output, which carries them; None once sent, or when not asked
    prompt_logprobs: list | None = None
    # LoRA: the adapter serving it ("" is the base model) and, while it holds one, the device
    # slot its adapter sits in (-1: none; the runner reads this per token row)
    lora: str = ""
    lora_slot: int = -1
    # sampler.plain_sampling(sampling), worked out once: the sampler's shortcut for the defaults
    plain_sampling: bool = False
    # speculative decoding: whether its tokens may be proposed ahead and verified in one step
    # (engine.speculates), and its n-gram index (speculative/ngram.py), built on first use
    speculates: bool = False
    ngrams: object | None = None
    # verifications in a row that kept no proposal, and the steps to go before the next
    # proposal (speculative/proposals.py backs off while guesses keep failing)
    proposal_misses: int = 0
    proposal_pause: int = 0
    # --scheduling-policy priority: lower runs earlier (vLLM's); the tenant, for fair share
    priority: int = 0
    tenant: str = ""

    @property
    def scores_prompt(self) -> bool:
        """True while prompt logprobs are still to be computed: every prompt position must
        then run through the model, so the prefix cache must not skip any."""
        got = self.prompt_logprobs
        return got is not None and len(got) < len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to feed before the next sample (all of them after a preemption)."""
        return self.num_tokens - self.num_computed

    def token_slice(self, start: int, end: int) -> list[int]:
        prompt_len = len(self.prompt_ids)
        if end <= prompt_len:
            return self.prompt_ids[start:end]
        if start >= prompt_len:  # a decode step: no copy of the whole context
            return self.output_ids[start - prompt_len : end - prompt_len]
        return self.prompt_ids[start:] + self.output_ids[: end - prompt_len]
