"""When a sequence ends: the rule applied to each token it takes (vLLM v1's ``check_stop``).

In the order checked: a grammar that rejects the token ends it with ``error`` (the mask let
the token through, so the matcher's state is broken) and one that allows nothing more ends it
with ``stop``; a stop token or EOS ends it with ``stop``, but only once ``min_tokens`` are out;
``max_tokens`` reached ends it with ``length``, as does the context (``max_model_len``) filled.

It lives alone because it is one rule that needs no pool, queue or budget: the policy
(policy.py) calls it for each token a step emits, and a test can call it with a sequence and a
token. It is not a pure check, though: the reasoning split and the grammar matcher advance on
the token, so it is called once per token, in order, after the token joins ``output_ids``.
"""

from __future__ import annotations

from collections.abc import Container

from tokenline.reasoning import ANSWER
from tokenline.scheduler.sequence import Sequence


def finish_reason(
    seq: Sequence, token: int, eos_ids: Container[int], max_model_len: int | None
) -> str | None:
    """Why ``seq`` ends on ``token``: ``stop``, ``length`` or ``error``; None: it goes on."""
    s = seq.sampling
    thought = seq.reasoning is not None and seq.reasoning.step(token) != ANSWER
    if seq.matcher is not None and not thought:  # a grammar starts after the thinking
        if not seq.matcher.consume_token(token) or seq.matcher.is_error():
            return "error"  # the mask allowed it, so the matcher's state is broken
        if seq.matcher.is_stopped():
            return "stop"  # the output is complete: the grammar allows nothing more
    if len(seq.output_ids) >= s.min_tokens:
        if token in s.stop_token_ids:
            return "stop"
        if not s.ignore_eos and token in eos_ids:
            return "stop"
    if len(seq.output_ids) >= seq.max_tokens:
        return "length"
    # the runner's positions end at the context; on the ring max_tokens (held to the
    # context by the tokenizer stage) has ended the sequence by then
    if max_model_len is not None and seq.num_tokens >= max_model_len:
        return "length"
    return None
