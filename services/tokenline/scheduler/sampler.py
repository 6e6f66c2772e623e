"""Logits to tokens, on the model's device, with each request's own sampling parameters."""

from __future__ import annotations

from collections import Counter

import torch

from tokenline.protocol import SamplingParams, TokenLogprobs
from tokenline.scheduler.sequence import Sequence
from tokenline.scheduler.step_inputs import float_tensor, long_tensor, to_device

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
        return tokens.tolist(), out  # the step's one copy back to the host
    rows = to_device(long_tensor(asked), logits.device)
    top_n = max(seqs[i].sampling.logprobs for i in asked)
    reduced = reduce_logprobs(raw, tokens[rows], top_n)
    # the tokens and the logprobs come back in one copy, after every kernel of the step
    token_list, *lists = copy_back(tokens, *reduced)
    token_list = [int(t) for t in token_list]
    entries = token_logprobs(
        [token_list[i] for i in asked], lists, [seqs[i].sampling.logprobs for i in asked]
    )
    for i, entry in zip(asked, entries, strict=True):
        out[i] = entry
    return token_list, out


def copy_back(*tensors: torch.Tensor) -> list[list]:
    """Several device tensors' values as lists, in one copy to the host: packed as float64,
    which holds every token id and every float32 logprob exactly. Rows of a 2-D tensor stay
    rows."""
    packed = torch.cat([t.reshape(-1).double() for t in tensors]).tolist()
    lists, at = [], 0
    for t in tensors:
        flat = packed[at : at + t.numel()]
        at += t.numel()
        if t.dim() == 2:
            width = t.shape[1]
            flat = [flat[i * width : (i + 1) * width] for i in range(t.shape[0])]
        lists.append(flat)
    return lists


def reduce_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, top_n: int) -> Reduced:
    """On the device: each row's log-probability of its token, and its ``top_n`` likeliest
    tokens' (log-probabilities, ids), most likely first. ``raw``: [rows, vocab] log-softmaxed
    logits; ``token_ids``: [rows]. Small enough to copy back, whatever the vocabulary."""
    chosen = raw.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top_values, top_ids = torch.topk(raw, min(top_n, raw.shape[1]), dim=-1, sorted=True)
    return chosen, top_values, top_ids


def token_logprobs(token_ids: list[int], reduced: list, top_ns: list[int]) -> list[TokenLogprobs]:
    """`reduce_logprobs`'s rows, copied back (`copy_back`), as one `TokenLogprobs` each, row k
    keeping its ``top_ns[k]`` alternatives."""
    chosen, top_values, top_ids = reduced
    return [
        TokenLogprobs(
            token_id=token,
            logprob=value,
            top_ids=[int(i) for i in ids[:n]],
            top_logprobs=values[:n],
        )
        for token, value, ids, values, n in zip(
            token_ids, chosen, top_ids, top_values, top_ns, strict=True
        )
    ]


def _sample(
    logits: torch.Tensor,
    seqs: list[Sequence],
    eos_ids: list[int],
    allowed: tuple[list[int], torch.Tensor] | None = None,
) -> torch.Tensor:
    # the common case, every row at the defaults: one pass over the rows instead of ten
    if allowed is None and all(seq.plain_sampling for seq in seqs):
        return _draw(torch.softmax(logits, dim=-1), seqs)
    _edit_logits(logits, seqs, eos_ids)
    if allowed is not None:
        rows, mask = allowed
        index = to_device(long_tensor(rows), logits.device)
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
        logits = logits / to_device(temps, device).unsqueeze(1)
    top_k = [s.sampling.top_k for s in seqs]
    top_p = [s.sampling.top_p for s in seqs]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    min_p = [s.sampling.min_p for s in seqs]
    if any(m > 0 for m in min_p):
        floor = to_device(float_tensor(min_p), device).unsqueeze(1)
        keep = probs >= floor * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(keep, probs, torch.zeros_like(probs))

    if tokens is None:
        return _draw(probs, seqs)
    rows = to_device(long_tensor(sampled), device)
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
    k = to_device(long_tensor([kk if kk > 0 else vocab for kk in top_k]), logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks >= k.unsqueeze(1), _NEG_INF)
    p = to_device(float_tensor(top_p), logits.device)
    probs = torch.softmax(sorted_logits, dim=-1)
    # drop a token when the tokens ranked above it already cover p
    cumulative = torch.cumsum(probs, dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(cumulative >= p.unsqueeze(1), _NEG_INF)
    return torch.full_like(logits, _NEG_INF).scatter(1, order, sorted_logits)


def _edit_logits(logits: torch.Tensor, seqs: list[Sequence], eos_ids: list[int]) -> None:
    """Every row's logit bias, penalties and min_tokens ban, in place, as a few batched
    writes: each kind of edit is gathered on the host as (row, token, value) triples, copied to
    the device once and applied to every row at once, in the order a row's own edits go (bias,
    repetition penalty, frequency and presence penalties, then the ban)."""
    bias: list[list] = [[], [], []]  # rows, tokens, biases
    repeated: list[list] = [[], [], []]  # rows, tokens seen, penalty
    counted: list[list] = [[], [], [], [], []]  # rows, tokens output, count, frequency, presence
    banned: list[list] = [[], []]  # rows, tokens
    for row, seq in enumerate(seqs):
        s = seq.sampling
        if s.logit_bias:
            bias[0] += [row] * len(s.logit_bias)
            bias[1] += list(s.logit_bias)
            bias[2] += list(s.logit_bias.values())
        if s.repetition_penalty != 1.0:
            seen = sorted(set(seq.prompt_ids + seq.output_ids))
            repeated[0] += [row] * len(seen)
            repeated[1] += seen
            repeated[2] += [s.repetition_penalty] * len(seen)
        if seq.output_ids and (s.frequency_penalty or s.presence_penalty):
            counts = Counter(seq.output_ids)
            counted[0] += [row] * len(counts)
            counted[1] += list(counts)
            counted[2] += list(counts.values())
            counted[3] += [s.frequency_penalty] * len(counts)
            counted[4] += [s.presence_penalty] * len(counts)
        # a grammar decides when the output may end: min_tokens must not ban what it allows
        if len(seq.output_ids) < s.min_tokens and seq.matcher is None:
            ban = ([] if s.ignore_eos else eos_ids) + list(s.stop_token_ids)
            banned[0] += [row] * len(ban)
            banned[1] += ban
    device = logits.device
    if bias[0]:
        rows, tokens = (to_device(long_tensor(v), device) for v in bias[:2])
        logits.index_put_((rows, tokens), to_device(float_tensor(bias[2]), device), True)
    if repeated[0]:
        rows, tokens = (to_device(long_tensor(v), device) for v in repeated[:2])
        penalty = to_device(float_tensor(repeated[2]), device)
        values = logits[rows, tokens]
        logits[rows, tokens] = torch.where(values > 0, values / penalty, values * penalty)
    if counted[0]:
        rows, tokens = (to_device(long_tensor(v), device) for v in counted[:2])
        count, frequency, presence = (to_device(float_tensor(v), device) for v in counted[2:])
        # as a dense row of counts would subtract: frequency * count + presence * (count > 0)
        logits[rows, tokens] -= frequency * count + presence
    if banned[0]:
        rows, tokens = (to_device(long_tensor(v), device) for v in banned)
        logits[rows, tokens] = _NEG_INF
