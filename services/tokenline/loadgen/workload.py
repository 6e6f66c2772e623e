"""The workload: length distributions, synthetic prompts and arrival times.

Everything is drawn from seeded ``random.Random`` instances, so every target of a run (and every
rerun with the same seed) gets the same prompts, the same output lengths and the same arrivals.

Three shapes share one description, a list of ``RequestSpec``:

- distinct prompts (the default): every prompt is its own random words;
- shared prefixes (``shared_prefix_len``): every prompt starts with one of ``prefix_groups``
  fixed runs of words, then its own words, as a system prompt or tool definitions would;
- conversations (``turns``): requests come in conversations of ``turns`` user messages; each
  request resends the conversation so far (built by the load, which knows the replies).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

# Plain words, most of them one token in common tokenizers; a prompt of N words is roughly
# N tokens (the server's `usage` reports the exact count).
WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is was for on that with as by at from his her it an be this are which or
    had not but one all were they she there been has have their more when will would who so
    time about out up into them can only other new some could these two may first then do any
    like my now over such our man me even most made after also did many before must through
    back years where much your way well down should because each just those people how too
    little state good very make world still own see men work long get here between both life
    being under never day same another know while last might us great old year off come since
    against go came right used take three city water house light river stone field garden
    window morning evening winter summer paper music story number market letter answer
    question country family school system program company problem service report power money
    table road forest valley island bridge engine signal cloud storm ocean mountain silver
    yellow green orange purple quiet gentle rapid simple careful bright heavy narrow distant
    """.split()
)


@dataclass(frozen=True)
class LengthDist:
    """A length distribution: fixed (``low == high``) or uniform over ``[low, high]``."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """Parse ``"64"`` (fixed) or ``"32:128"`` (uniform, both ends included)."""
        parts = text.split(":")
        try:
            values = [int(part) for part in parts]
        except ValueError:
            raise ValueError(f"length must be N or LOW:HIGH, got {text!r}") from None
        if len(values) == 1:
            values = values * 2
        if len(values) != 2 or values[0] < 1 or values[1] < values[0]:
            raise ValueError(f"length must be N or LOW:HIGH with 1 <= LOW <= HIGH, got {text!r}")
        return cls(values[0], values[1])

    def sample(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload; the same spec is sent to every target.

    ``prompt`` is the whole prompt, or in a conversation this turn's new user message (the
    first one begins with the shared prefix, if any). ``prompt_words`` counts its words,
    ``prefix_words`` of them shared with the other requests of ``prefix_group``.
    """

    index: int
    prompt: str
    prompt_words: int
    max_tokens: int
    conversation: int = 0
    turn: int = 0
    prefix_words: int = 0
    prefix_group: int | None = None


def synth_prompt(rng: random.Random, words: int) -> str:
    """A prompt of ``words`` random words (distinct prompts defeat prefix caches)."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


def shared_prefixes(words: int, groups: int, seed: int) -> list[str]:
    """``groups`` different prefixes of ``words`` words each.

    Drawn apart from the per-request words, so that adding a prefix leaves the rest of the
    workload as it was, and so that the warm-up (another seed) can share the run's prefixes.
    """
    return [
        synth_prompt(random.Random(f"tokenline-bench-prefix:{seed}:{group}"), words)
        for group in range(groups)
    ]


def build_workload(
    num_requests: int,
    prompt_len: LengthDist,
    output_len: LengthDist,
    seed: int,
    *,
    shared_prefix_len: int = 0,
    prefix_groups: int = 1,
    turns: int = 1,
    prefix_seed: int | None = None,
) -> list[RequestSpec]:
    """The ``num_requests`` request specs of a run, reproducible from ``seed``.

    Request ``i`` is turn ``i % turns`` of conversation ``i // turns``; conversation ``c``
    starts with the prefix of group ``c % prefix_groups``, so the groups get equal shares.
    ``prompt_len`` is the length of each request's own words (each user message's, in a
    conversation). Prefixes come from ``prefix_seed`` (default ``seed``).
    """
    if shared_prefix_len < 0 or prefix_groups < 1 or turns < 1:
        raise ValueError("shared_prefix_len must be >= 0, prefix_groups and turns >= 1")
    prefixes = shared_prefixes(
        shared_prefix_len, prefix_groups, seed if prefix_seed is None else prefix_seed
    )
    rng = random.Random(seed)
    specs = []
    for index in range(num_requests):
        words = prompt_len.sample(rng)
        prompt = synth_prompt(rng, words)
        conversation, turn = divmod(index, turns)
        group, prefix_words = None, 0
        if shared_prefix_len and turn == 0:
            group, prefix_words = conversation % prefix_groups, shared_prefix_len
            prompt = f"{prefixes[group]} {prompt}"
        specs.append(
            RequestSpec(
                index=index,
                prompt=prompt,
                prompt_words=words + prefix_words,
                max_tokens=output_len.sample(rng),
                conversation=conversation,
                turn=turn,
                prefix_words=prefix_words,
                prefix_group=group,
            )
        )
    return specs


def reword(specs: list[RequestSpec], seed: str) -> list[RequestSpec]:
    """The same requests with new words of their own: same lengths, same shared prefixes.

    A later round gets reworded specs, so that a server with a prefix cache does not find
    the whole prompts of the round before it.
    """
    rng = random.Random(f"tokenline-bench-reword:{seed}")
    out = []
    for spec in specs:
        prefix = spec.prompt.split(" ")[: spec.prefix_words]
        own = synth_prompt(rng, spec.prompt_words - spec.prefix_words)
        prompt = " ".join([*prefix, own]) if prefix else own
        out.append(replace(spec, prompt=prompt))
    return out


def conversations(specs: list[RequestSpec]) -> list[list[RequestSpec]]:
    """The specs grouped by conversation, each in turn order; conversations in spec order."""
    grouped: dict[int, list[RequestSpec]] = {}
    for spec in specs:
        grouped.setdefault(spec.conversation, []).append(spec)
    return [sorted(turns, key=lambda spec: spec.turn) for turns in grouped.values()]


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (seconds from the phase start) of a Poisson process of ``rate`` req/s.

    The first request arrives at 0; the gaps are exponential with mean ``1 / rate``.
    """
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"request rate must be a positive finite number, got {rate}")
    rng = random.Random(seed ^ 0x5EED)
    arrivals, now = [], 0.0
    for _ in range(num_requests):
        arrivals.append(now)
        now += rng.expovariate(rate)
    return arrivals
