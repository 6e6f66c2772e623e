"""Constrained decoding: one llguidance matcher per constrained sequence, masks on the device.

llguidance rather than xgrammar: it is one dependency-free abi3 wheel (it also carries to a GPU
machine with no package registry), it computes masks lazily from an Earley parser over a
derivative-based lexer, so a new schema costs no ahead-of-time compile of the whole vocabulary,
and its JSON Schema coverage is broad, with clear errors for what it cannot enforce.

A grammar's first matcher is built on a worker thread, never in the step loop: the request
waits outside the decode batch until it is ready. Built matchers are kept pristine, by grammar
text, and every later request with the same grammar starts from a copy. The cache is bounded
in entries and in an estimate of the matchers' memory, since a client chooses the grammar.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.hf
import torch

from tokenline.bounded import LruCache
from tokenline.metrics import GRAMMAR_COMPILE_TIME

CACHE_SIZE = 64  # distinct grammars kept ready; a copy of one is microseconds
CACHE_BYTES = 64 * 2**20  # estimated matcher memory kept, over every cached grammar
# A built matcher's memory, estimated from its grammar's length: a fixed part (lexer and
# parser state for the tokenizer) and a part that grows with the grammar, both measured
# (benchmarks/README.md, "Soak"). A grammar over a quarter of CACHE_BYTES is built every time.
MATCHER_BASE_BYTES = 64 * 2**10
MATCHER_BYTES_PER_CHAR = 64
_BITS = 32


def packed_masks(rows: int, vocab_size: int) -> torch.Tensor:
    """``rows`` masks in llguidance's layout (32 tokens an int32, every token allowed), for
    its matchers to write; pinned where a GPU will read them. llguidance.torch has the same
    helper, but importing that module wraps a kernel in torch.compile, which imports dynamo
    and inductor into every scheduler: seconds of start-up on two cores, for a kernel this
    module never calls."""
    shape = (rows, (vocab_size + _BITS - 1) // _BITS)
    if torch.cuda.is_available():
        try:
            return torch.full(shape, -1, dtype=torch.int32, pin_memory=True)
        except RuntimeError:  # no page-locked memory to be had: a plain copy still works
            pass
    return torch.full(shape, -1, dtype=torch.int32)


class GrammarError(ValueError):
    """The grammar cannot be enforced; the request's fault (a 400, param response_format)."""


def matcher_cost(grammar: str, matcher: object) -> int:
    """Estimated bytes a kept matcher holds (its grammar text included)."""
    return MATCHER_BASE_BYTES + MATCHER_BYTES_PER_CHAR * len(grammar)


class _TextTokens:
    """The model's tokens for llguidance with only its special tokens special.

    llguidance's own reading of a tokenizer (``llguidance.hf.from_tokenizer``) makes every
    added token special, the ones added as text too (Qwen's ``<tool_call>``, ``<think>``): a
    grammar's ``"<tool_call>"`` then allows that token in its mask and refuses it when
    consumed, and a forced tool call ends in an error. Here they are text, as the tokenizer
    itself decodes them; text never encodes to a special token, so a grammar spells what it
    forces in text tokens and its mask and its matcher agree."""

    def __init__(self, hf_tokenizer, read: llguidance.LLTokenizer) -> None:
        self._hf = hf_tokenizer
        self.eos_token_id = read.eos_token
        self.bos_token_id = None
        self.tokens = [read.decode_bytes([i]) for i in range(read.vocab_size)]
        added = getattr(hf_tokenizer, "added_tokens_decoder", {})
        special = {i for i, token in added.items() if token.special}
        special |= set(hf_tokenizer.all_special_ids)
        self.special_token_ids = sorted(i for i in special if i < read.vocab_size)

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # llguidance then passes text, not bytes
            raise TypeError("text only")
        return self._hf.encode(text, add_special_tokens=False, split_special_tokens=True)


def grammar_tokenizer(hf_tokenizer) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of a transformers one (`_TextTokens` says why not its own)."""
    read = llguidance.hf.from_tokenizer(hf_tokenizer)
    wrapped = llguidance.TokenizerWrapper(_TextTokens(hf_tokenizer, read))
    return llguidance.LLTokenizer(wrapped, n_vocab=read.vocab_size, eos_token=read.eos_tokens)


class GrammarCompiler:
    """Builds matchers for grammar strings, off the caller's thread, cached by grammar."""

    def __init__(self, tokenizer, workers: int = 1) -> None:  # tokenizer: a transformers one
        self.tokenizer = grammar_tokenizer(tokenizer)
        self.vocab_size = self.tokenizer.vocab_size
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar")
        self.cache: LruCache[str, llguidance.LLMatcher] = LruCache(
            CACHE_SIZE, CACHE_BYTES, matcher_cost
        )
        self._executor = llguidance.LLExecutor()
        self._latency = GRAMMAR_COMPILE_TIME.labels(stage="scheduler")

    def cached(self, grammar: str) -> llguidance.LLMatcher | None:
        """A fresh matcher at once when this grammar was built before, else None."""
        pristine = self.cache.get(grammar)
        return None if pristine is None else pristine.deep_copy()

    def submit(self, grammar: str) -> Future:
        """A future of a fresh matcher; it raises `GrammarError` for a grammar that fails."""
        return self._pool.submit(self._build, grammar)

    def _build(self, grammar: str) -> llguidance.LLMatcher:
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        # The first mask builds the lexer's start states: do that here too, not in a step.
        first = packed_masks(1, self.vocab_size)
        matcher.unsafe_compute_mask_ptr(first.data_ptr(), first.numel() * first.element_size())
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        self._latency.observe(time.perf_counter() - started)
        return matcher

    def keep(self, grammar: str, matcher: llguidance.LLMatcher) -> llguidance.LLMatcher:
        """Remember a freshly built matcher (called on the step loop's thread) and return a
        copy to use, so the kept one stays at the grammar's start."""
        self.cache.put(grammar, matcher)
        return matcher.deep_copy()

    def masks(self, matchers: list[llguidance.LLMatcher], width: int, device) -> torch.Tensor:
        """Allowed tokens, [len(matchers), width] booleans on ``device``.

        The masks are computed on the CPU (in parallel, by llguidance's executor) and unpacked
        on the device; the logits never leave it. Columns past the tokenizer's vocabulary (a
        model may pad its embedding) are never allowed.
        """
        packed = packed_masks(len(matchers), self.vocab_size)
        row_bytes = packed.shape[1] * packed.element_size()
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], packed.data_ptr(), row_bytes, len(matchers)
        )
        packed = packed.to(device, non_blocking=True)
        bits = torch.arange(_BITS, device=device, dtype=torch.int32)
        allowed = ((packed.unsqueeze(-1) >> bits) & 1).bool().flatten(1)
        allowed = allowed[:, : min(width, self.vocab_size)]
        if allowed.shape[1] < width:
            pad = torch.zeros(len(matchers), width - allowed.shape[1], dtype=torch.bool)
            allowed = torch.cat([allowed, pad.to(device)], dim=1)
        return allowed

    def step_masks(self, seqs: list, logits: torch.Tensor, start_id: int | None):
        """The rows of a step (`Sequence`s) whose next token a grammar constrains, and their
        allowed tokens; None when no row's is. A row still thinking is free (its grammar
        holds from the answer's first token); a row whose output may open a thinking block
        may also take ``start_id`` (``<think>``)."""
        constrained = [
            i
            for i, seq in enumerate(seqs)
            if seq.matcher is not None and not (seq.reasoning and seq.reasoning.reasoning)
        ]
        if not constrained:
            return None
        matchers = [seqs[i].matcher for i in constrained]
        masks = self.masks(matchers, logits.shape[1], logits.device)
        for row, i in enumerate(constrained):
            if seqs[i].reasoning is not None and seqs[i].reasoning.may_open:
                masks[row, start_id] = True
        return constrained, masks

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
