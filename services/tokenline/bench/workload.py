"""The workload: length distributions, synthetic prompts and arrival times.

Everything is drawn from one seeded ``random.Random``, so every target of a run (and every
rerun with the same seed) gets the same prompts, the same output lengths and the same arrivals.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

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
    """One request of the workload; the same spec is sent to every target."""

    index: int
    prompt: str
    prompt_words: int
    max_tokens: int


def synth_prompt(rng: random.Random, words: int) -> str:
    """A prompt of ``words`` random words (distinct prompts defeat prefix caches)."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


def build_workload(
    num_requests: int, prompt_len: LengthDist, output_len: LengthDist, seed: int
) -> list[RequestSpec]:
    """The ``num_requests`` request specs of a run, reproducible from ``seed``."""
    rng = random.Random(seed)
    specs = []
    for index in range(num_requests):
        words = prompt_len.sample(rng)
        specs.append(
            RequestSpec(
                index=index,
                prompt=synth_prompt(rng, words),
                prompt_words=words,
                max_tokens=output_len.sample(rng),
            )
        )
    return specs


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
