"""Prompt logprobs (``sampling.prompt_logprobs``): each prompt token's log-probability given the
tokens before it, with the likeliest alternatives, as the prompt's prefill computes them.

Prompt token ``i`` is scored by the logits at position ``i - 1``, so a prefill chunk over
positions ``[start, start + n)`` scores prompt tokens ``start + 1 .. start + n`` (the last
prompt position's logits give the first output token instead, as sampling always did). The
scores gather on the sequence across chunks (the policy appends them); its first output
carries them. Every prompt position must run through the model, so such a sequence skips
prefix-cache hits until it is scored (policy.py); a preempted one keeps what it gathered and
scores only the rest.

Memory stays bounded whatever the prompt: the runner keeps only the chunk's final hidden
states, and they become logits a slice of rows at a time, each slice reduced on the device to
the actual token's log-probability and the top N before the next one (`sampler.reduce_logprobs`,
the same reduction as sampled tokens' logprobs, over the same raw distribution).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenline.protocol import TokenLogprobs
from tokenline.scheduler.policy import Chunk
from tokenline.scheduler.sampler import copy_back, reduce_logprobs, token_logprobs
from tokenline.scheduler.sequence import Sequence

# Logits elements per slice: 2**25 float32 values are 128 MiB (twice that with log_softmax's
# copy), 220 rows of a 152k-token vocabulary.
SLICE_ELEMENTS = 1 << 25
# A request's prompt logprobs travel in one message and are rendered per token by the
# detokenizer and the api: prompt tokens times (1 + top N) values are refused past this.
MAX_VALUES = 1 << 18
MAX_TOP = 20  # alternatives per prompt token, as for sampled tokens (chat's top_logprobs)


@dataclass
class Span:
    """Rows of one chunk to score: positions ``first .. first + count - 1`` of ``seq``."""

    chunk: int  # index of the chunk in the step
    offset: int  # first row within the chunk
    count: int
    seq: Sequence
    first: int  # the first row's position in the sequence

    @property
    def targets(self) -> list[int]:
        """The prompt tokens these rows score: each row's next token."""
        return self.seq.prompt_ids[self.first + 1 : self.first + 1 + self.count]


def refusal(prompt_len: int, top_n: int) -> str | None:
    """Why prompt logprobs cannot be given for this request; None when they can."""
    if not 0 <= top_n <= MAX_TOP:
        return f"logprobs is {top_n}; ask for 0 to {MAX_TOP} alternatives per prompt token"
    if prompt_len * (1 + top_n) > MAX_VALUES:
        return (
            f"the prompt's logprobs would be {prompt_len} tokens x {1 + top_n} values, over "
            f"the {MAX_VALUES} this server returns; send a shorter prompt or fewer logprobs"
        )
    return None


def spans(chunks: list[Chunk]) -> list[Span]:
    """The rows of this step's chunks whose logits score prompt tokens not scored yet."""
    out = []
    for k, chunk in enumerate(chunks):
        seq = chunk.seq
        if not seq.scores_prompt:
            continue
        first = len(seq.prompt_logprobs) - 1  # the row that scores the next missing token
        if first < chunk.start:
            raise RuntimeError(
                f"{seq.uid}: positions {first}..{chunk.start - 1} were skipped, so its prompt "
                "logprobs would have a hole (a prefix-cache hit must not be used)"
            )
        end = min(chunk.start + chunk.num_tokens, len(seq.prompt_ids) - 1)
        if end > first:
            out.append(Span(k, first - chunk.start, end - first, seq, first))
    return out


@torch.inference_mode()
def score(runner, hidden: torch.Tensor, spans: list[Span]) -> list[tuple[Sequence, list]]:
    """Each span's entries, with its sequence, for the policy to append to the sequence's
    ``prompt_logprobs`` (``StepOutput.prompt_logprobs``).

    ``hidden``: the spans' final hidden states from ``runner.forward_keeping``, in order."""
    targets = [t for span in spans for t in span.targets]
    top_ns = [span.seq.sampling.prompt_logprobs for span in spans for _ in range(span.count)]
    top_n = max(top_ns)
    target_ids = torch.tensor(targets, dtype=torch.long, device=hidden.device)
    rows = max(1, SLICE_ELEMENTS // runner.vocab_size)
    parts = []
    for start in range(0, len(targets), rows):
        logits = runner.logits(hidden[start : start + rows])
        raw = torch.log_softmax(logits, dim=-1)
        del logits
        parts.append(reduce_logprobs(raw, target_ids[start : start + rows], top_n))
        del raw  # the slice's logits are gone before the next slice's exist
    reduced = copy_back(*(torch.cat(column) for column in zip(*parts, strict=True)))
    entries: list[TokenLogprobs] = token_logprobs(targets, reduced, top_ns)
    scored = []
    at = 0
    for span in spans:
        scored.append((span.seq, entries[at : at + span.count]))
        at += span.count
    return scored
