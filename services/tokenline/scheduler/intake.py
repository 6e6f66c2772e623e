"""What the engine takes in: whether it can ever serve a request, decided before it holds
anything (the refusals of `Engine.add`), and the ``max_tokens`` it may run to. Apart from the
engine so the rules read in one place and need no runner or policy to test.

Requests come checked by the tokenizer stage, which owns the rules on a prompt's length: at
least one token (an empty prompt here is a caller's bug), and ``max_tokens`` filled in and held
to the context length (capped here at the KV pool alone; `BatchPolicy` ends a sequence at the
context, whatever an in-process caller asked)."""

from __future__ import annotations

from tokenline.protocol import SamplingParams
from tokenline.scheduler import prompt_logprobs
from tokenline.scheduler.kv_cache import BlockPool
from tokenline.scheduler.kv_transfer.transfers import KVTransfers, check_kv_transfer
from tokenline.scheduler.lora.slots import LoraSlots
from tokenline.scheduler.refusals import InvalidRequest, UnknownModel, check_fits, check_sampling


def check_request(
    uid: str,
    prompt_ids: list[int],
    sampling: SamplingParams,
    *,
    lora: str,
    loras: LoraSlots | None,
    vocab_size: int,
    pool: BlockPool,
    grammar_refusal: str,
    transfers: KVTransfers | None,
) -> int:
    """The ``max_tokens`` the request may run to, or the refusal it fails with.

    ``grammar_refusal``: why a grammar is refused, "" where grammars are served.
    """
    if lora and (loras is None or not loras.known(lora)):
        raise UnknownModel(f"The model `{lora}` does not exist.")
    if not prompt_ids:  # the tokenizer stage refuses these: a caller that skipped it
        raise ValueError(f"{uid}: an empty prompt; the engine needs at least one token")
    # The tokenizer stage bounds ids by the tokenizer, which may hold more than the model's
    # embedding has rows: an id past them would fail the step (on a GPU, the device).
    highest = max(prompt_ids)
    if highest >= vocab_size or min(prompt_ids) < 0:
        raise InvalidRequest(
            f"prompt token id {highest} is not in the model's vocabulary of {vocab_size} ids",
            param="prompt",
        )
    check_fits(len(prompt_ids), pool.capacity, "prompt")
    check_sampling(sampling, vocab_size, grammar_refusal)
    if sampling.prompt_logprobs is not None:
        reason = prompt_logprobs.refusal(len(prompt_ids), sampling.prompt_logprobs)
        if reason is not None:
            raise InvalidRequest(reason, param="logprobs")
    check_kv_transfer(transfers, sampling)
    # A request never grows past the whole KV pool: one that outgrew it could only preempt
    # itself forever (the context is the tokenizer stage's and the policy's to hold).
    room = pool.capacity - len(prompt_ids)
    # max_tokens 0: the prompt is only read (its logprobs, with echo), nothing generated
    return room if sampling.max_tokens is None else min(sampling.max_tokens, room)
