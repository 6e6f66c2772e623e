"""Logits to tokens, on the model's device, with each request's own sampling parameters."""

from __future__ import annotations

import torch

from tokenline.protocol import TokenLogprobs
from tokenline.scheduler.sequence import Sequence

_NEG_INF = float("-inf")


def _apply_penalties(logits: torch.Tensor, row: int, seq: Sequence) -> None:
    s = seq.sampling
    if not seq.output_ids and s.repetition_penalty == 1.0:
        return
    device = logits.device
    if s.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.prompt_ids + seq.output_ids)), device=device)
        values = logits[row, seen]
        logits[row, seen] = torch.where(
            values > 0, values / s.repetition_penalty, values * s.repetition_penalty
        )
    if seq.output_ids and (s.frequency_penalty or s.presence_penalty):
        counts = torch.bincount(
            torch.tensor(seq.output_ids, device=device), minlength=logits.shape[1]
        ).to(logits.dtype)
        logits[row] -= s.frequency_penalty * counts + s.presence_penalty * (counts > 0).to(
            logits.dtype
        )


@torch.inference_mode()  # the logits come from an inference-mode forward; edits stay in it
def sample_with_logprobs(
    logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One token per row of ``logits`` ([len(seqs), vocab]), and its log-probability for the
    rows that asked.

    Log-probabilities are those of the model's raw distribution: ``log_softmax`` of the logits
    before penalties, bans and temperature (what vLLM reports by default). They are computed
    on the device, only for the rows that asked, and copied back once.
    """
    logits = logits.float()
    asked = [i for i, s in enumerate(seqs) if s.sampling.logprobs is not None]
    raw = torch.log_softmax(logits[asked], dim=-1) if asked else None  # a copy: edits below
    tokens = _sample(logits, seqs, eos_ids)
    out: list[TokenLogprobs | None] = [None] * len(seqs)
    if raw is None:
        return tokens.tolist(), out
    rows = torch.tensor(asked, device=logits.device)
    chosen = raw.gather(1, tokens[rows].unsqueeze(1)).squeeze(1)
    top_n = min(max(seqs[i].sampling.logprobs for i in asked), raw.shape[1])
    top_values, top_ids = torch.topk(raw, top_n, dim=-1, sorted=True)
    # copied back only now, after every kernel of the step is queued
    token_list, chosen_list = tokens.tolist(), chosen.tolist()
    top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    for k, i in enumerate(asked):
        n = seqs[i].sampling.logprobs
        out[i] = TokenLogprobs(
            token_id=token_list[i],
            logprob=chosen_list[k],
            top_ids=top_ids_list[k][:n],
            top_logprobs=top_values_list[k][:n],
        )
    return token_list, out


def _sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int]) -> torch.Tensor:
    for row, seq in enumerate(seqs):
        s = seq.sampling
        if s.repetition_penalty != 1.0 or s.frequency_penalty or s.presence_penalty:
            _apply_penalties(logits, row, seq)
        if len(seq.output_ids) < s.min_tokens:
            banned = ([] if s.ignore_eos else eos_ids) + list(s.stop_token_ids)
            if banned:
                logits[row, banned] = _NEG_INF

    temps = torch.tensor([s.sampling.temperature for s in seqs], device=logits.device)
    greedy = temps <= 0
    tokens = torch.argmax(logits, dim=-1)
    if bool(greedy.all()):
        return tokens

    logits = logits / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(1)
    top_k = [s.sampling.top_k for s in seqs]
    top_p = [s.sampling.top_p for s in seqs]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    min_p = torch.tensor([s.sampling.min_p for s in seqs], device=logits.device)
    if bool((min_p > 0).any()):
        keep = probs >= min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(keep, probs, torch.zeros_like(probs))

    unseeded = [i for i, s in enumerate(seqs) if s.generator is None and not greedy[i]]
    if unseeded:
        rows = torch.tensor(unseeded, device=logits.device)
        tokens[rows] = torch.multinomial(probs[rows], 1).squeeze(1)
    for i, seq in enumerate(seqs):
        # A seeded request draws from its own generator, so its output does not depend on
        # what else shares the batch.
        if seq.generator is not None and not greedy[i]:
            tokens[i] = torch.multinomial(probs[i], 1, generator=seq.generator)[0]
    return tokens


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks >= k.unsqueeze(1), _NEG_INF)
    p = torch.tensor(top_p, device=logits.device, dtype=logits.dtype)
    probs = torch.softmax(sorted_logits, dim=-1)
    # drop a token when the tokens ranked above it already cover p
    cumulative = torch.cumsum(probs, dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(cumulative >= p.unsqueeze(1), _NEG_INF)
    return torch.full_like(logits, _NEG_INF).scatter(1, order, sorted_logits)
