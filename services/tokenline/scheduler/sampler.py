"""Logits to tokens, on the model's device, with each request's own sampling parameters."""

from __future__ import annotations

import torch

from tokenline.protocol import SamplingParams, TokenLogprobs
from tokenline.scheduler.sequence import Sequence
from tokenline.scheduler.step_inputs import float_tensor, long_tensor

_NEG_INF = float("-inf")
_LARGEST_UNDER_ONE = 1 - 2**-24  # in float32
# Temperatures under this are greedy, their limit: logits divided by less can overflow float32,
# and a temperature under about 1e-45 is 0 there
_GREEDY_BELOW = 1e-5
# reduce_logprobs' result: (chosen [rows], top values [rows, n], top ids [rows, n])
Reduced = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# every field `_sample` reads from a row's SamplingParams (stop_token_ids and ignore_eos only
# matter with min_tokens): a row with all of them at their defaults needs only the draw
_SAMPLER_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "min_tokens",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
)
_DEFAULTS = SamplingParams()


def plain_sampling(sampling: SamplingParams) -> bool:
    """True when every field the sampler reads has its default (temperature 1, no top-k,
    top-p or min-p, no penalties, bias, min_tokens or seed): the row is drawn from the softmax
    of its logits as they are. Set on a `Sequence` when it is made."""
    return all(getattr(sampling, f) == getattr(_DEFAULTS, f) for f in _SAMPLER_FIELDS)


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
    logits: torch.Tensor,
    seqs: list[Sequence],
    eos_ids: list[int],
    allowed: tuple[list[int], torch.Tensor] | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One token per row of ``logits`` ([len(seqs), vocab]), and its log-probability for the
    rows that asked.

    ``allowed``: (rows, mask [len(rows), vocab] on the logits' device) for rows that follow a
    grammar: only their allowed tokens can be drawn, whatever biases and penalties say.

    Log-probabilities are those of the model's raw distribution: ``log_softmax`` of the logits
    before penalties, bans and temperature (what vLLM reports by default). They are computed
    on the device, only for the rows that asked, and copied back once.
    """
    logits = logits.float()
    asked = [i for i, s in enumerate(seqs) if s.sampling.logprobs is not None]
    raw = torch.log_softmax(logits[asked], dim=-1) if asked else None  # a copy: edits below
    tokens = _sample(logits, seqs, eos_ids, allowed)
    out: list[TokenLogprobs | None] = [None] * len(seqs)
    if raw is None:
        return tokens.tolist(), out
    rows = torch.tensor(asked, device=logits.device)
    top_n = max(seqs[i].sampling.logprobs for i in asked)
    reduced = reduce_logprobs(raw, tokens[rows], top_n)
    # copied back only now, after every kernel of the step is queued
    token_list = tokens.tolist()
    entries = token_logprobs(
        [token_list[i] for i in asked], reduced, [seqs[i].sampling.logprobs for i in asked]
    )
    for i, entry in zip(asked, entries, strict=True):
        out[i] = entry
    return token_list, out


def reduce_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, top_n: int) -> Reduced:
    """On the device: each row's log-probability of its token, and its ``top_n`` likeliest
    tokens' (log-probabilities, ids), most likely first. ``raw``: [rows, vocab] log-softmaxed
    logits; ``token_ids``: [rows]. Small enough to copy back, whatever the vocabulary."""
    chosen = raw.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top_values, top_ids = torch.topk(raw, min(top_n, raw.shape[1]), dim=-1, sorted=True)
    return chosen, top_values, top_ids


def token_logprobs(
    token_ids: list[int], reduced: Reduced, top_ns: list[int]
) -> list[TokenLogprobs]:
    """`reduce_logprobs`'s rows copied back as one `TokenLogprobs` each, row k keeping its
    ``top_ns[k]`` alternatives."""
    chosen, top_values, top_ids = (t.tolist() for t in reduced)
    return [
        TokenLogprobs(token_id=token, logprob=value, top_ids=ids[:n], top_logprobs=values[:n])
        for token, value, ids, values, n in zip(
            token_ids, chosen, top_ids, top_values, top_ns, strict=True
        )
    ]


def _apply_logit_bias(logits: torch.Tensor, row: int, bias: dict[int, float]) -> None:
    device = logits.device
    ids = torch.tensor(list(bias), device=device)
    logits[row, ids] += torch.tensor(list(bias.values()), device=device, dtype=logits.dtype)


def _sample(
    logits: torch.Tensor,
    seqs: list[Sequence],
    eos_ids: list[int],
    allowed: tuple[list[int], torch.Tensor] | None = None,
) -> torch.Tensor:
    # the common case, every row at the defaults: one pass over the rows instead of ten
    if allowed is None and all(seq.plain_sampling for seq in seqs):
        return _draw(torch.softmax(logits, dim=-1), seqs)
    for row, seq in enumerate(seqs):
        s = seq.sampling
        if s.logit_bias:
            _apply_logit_bias(logits, row, s.logit_bias)
        if s.repetition_penalty != 1.0 or s.frequency_penalty or s.presence_penalty:
            _apply_penalties(logits, row, seq)
        # a grammar decides when the output may end: min_tokens must not ban what it allows
        if len(seq.output_ids) < s.min_tokens and seq.matcher is None:
            banned = ([] if s.ignore_eos else eos_ids) + list(s.stop_token_ids)
            if banned:
                logits[row, banned] = _NEG_INF
    if allowed is not None:
        rows, mask = allowed
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~mask, _NEG_INF)

    temperatures = [s.sampling.temperature for s in seqs]
    sampled = [i for i, t in enumerate(temperatures) if t >= _GREEDY_BELOW]
    # the greedy rows' tokens; no argmax over the batch when no row is greedy
    tokens = torch.argmax(logits, dim=-1) if len(sampled) < len(seqs) else None
    if not sampled:
        return tokens

    device = logits.device
    # x / 1 is x exactly, so the common case of every row at temperature 1 needs no division
    # (nor a copy of the logits). Otherwise a tensor even when every row shares one
    # temperature: a GPU multiplies by the inverse of a plain number, and a seeded row's bits
    # must not depend on what shares its batch.
    if any(t != 1.0 for t in temperatures):
        temps = float_tensor([t if t >= _GREEDY_BELOW else 1.0 for t in temperatures])
        logits = logits / temps.to(device).unsqueeze(1)
    top_k = [s.sampling.top_k for s in seqs]
    top_p = [s.sampling.top_p for s in seqs]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    min_p = [s.sampling.min_p for s in seqs]
    if any(m > 0 for m in min_p):
        floor = float_tensor(min_p).to(device).unsqueeze(1)
        keep = probs >= floor * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(keep, probs, torch.zeros_like(probs))

    if tokens is None:
        return _draw(probs, seqs)
    rows = long_tensor(sampled).to(device)
    tokens[rows] = _draw(probs.index_select(0, rows), [seqs[i] for i in sampled])
    return tokens


def _draw(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """One token per row of ``probs`` ([rows, vocab], unnormalised, >= 0, one > 0) by inverse
    CDF.

    One uniform number per row instead of ``torch.multinomial``'s one per vocabulary entry:
    on CPU that was 0.4 ms of a 5 ms decode step for 16 rows of a 691-token vocabulary, and
    it grows with the vocabulary. A token of probability 0 (banned, cut by top-k/top-p/min-p)
    adds exactly 0 to the running sum, so no uniform number can select it. A seeded request
    draws its number from its own generator, so its output does not depend on what else
    shares the batch.
    """
    cdf = probs.cumsum(dim=-1)
    uniform = torch.rand(len(seqs), 1, device=probs.device, dtype=cdf.dtype)
    for i, seq in enumerate(seqs):
        if seq.generator is not None:
            uniform[i] = torch.rand(1, generator=seq.generator, device=probs.device)
    # A point at total itself would pass no running sum (an index past the vocabulary). For
    # u <= 1 - 2**-24, the largest float32 under 1, u * total rounds below total, so the draw
    # lands on a token of nonzero probability whatever the generator returned.
    uniform.clamp_(max=_LARGEST_UNDER_ONE)
    # token t wins for u in [cdf[t-1], cdf[t]): the first running sum that passes u * total
    drawn = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1)
    # A row with every token banned (all -inf, NaN probabilities) passes no sum either: it
    # must still get an id the model can read next step
    return drawn.clamp_(max=probs.shape[1] - 1)


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
