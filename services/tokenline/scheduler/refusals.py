"""Requests the engine can never serve: each fails at once with an OpenAI error."""

from __future__ import annotations

from tokenline.request_parts import SamplingParams


class InvalidRequest(ValueError):
    """A request the engine can never serve; it fails at once with an OpenAI error naming
    ``param``, the request field at fault."""

    code = "invalid_request_error"
    param: str | None = None
    http_status = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        if param is not None:
            self.param = param


class UnknownModel(InvalidRequest):
    """A request names a LoRA adapter this scheduler does not serve (OpenAI's 404)."""

    code = "model_not_found"
    param = "model"
    http_status = 404


class KVCacheTooSmall(InvalidRequest):
    """The prompt can never fit in the KV pool, however long it waits."""

    code = "kv_cache_too_small"
    param = "messages"


class KVLoadFailed(InvalidRequest):
    """A decode request's prompt KV could not be read from its prefill pod, under
    ``kv_load_failure_policy: fail`` (vLLM's default): the client may retry."""

    code = "kv_load_failed"
    param = "kv_transfer_params"
    http_status = 503


def check_fits(num_tokens: int, capacity: int, what: str, param: str | None = None) -> None:
    """Refuse ``num_tokens`` (a prompt, an input) that with the one token after it would not
    fit the whole KV pool (``capacity``, `BlockPool.capacity`): such a sequence could only
    wait, or preempt itself, forever."""
    if num_tokens + 1 > capacity:
        raise KVCacheTooSmall(
            f"the {what} needs {num_tokens} tokens of KV cache but the pool holds "
            f"{capacity}; raise --kv-cache-memory",
            param=param,
        )


def check_sampling(sampling: SamplingParams, vocab_size: int, grammar_refusal: str) -> None:
    """Refuse sampling fields no model of ``vocab_size`` tokens can honour, and a grammar
    where ``grammar_refusal`` says why grammars are off ("": they are on)."""
    last = vocab_size - 1
    token_ids = (  # (field, its token ids, how the error names the bad ones)
        ("stop_token_ids", sampling.stop_token_ids, lambda b: f"stop_token_ids {b} are"),
        ("logit_bias", sampling.logit_bias, lambda b: f"logit_bias names token ids {b[:8]}"),
    )
    for param, ids, names in token_ids:
        bad = [i for i in ids if not 0 <= i <= last]
        if bad:
            message = f"{names(bad)} outside the vocabulary (0..{last})"
            raise InvalidRequest(message, param=param)
    if sampling.grammar is not None and grammar_refusal:
        raise InvalidRequest(
            f"{grammar_refusal}; send the request without response_format or tools",
            param="response_format",
        )
