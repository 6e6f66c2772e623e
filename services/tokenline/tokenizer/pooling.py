"""Pooling requests in the tokenizer (``Generate.pooling``: embeddings, scores): a
cross-encoder's (query, document) pairs encoded as the model's tokenizer pairs them, and the
length rule of an input that generates nothing: it may fill the whole context."""

from __future__ import annotations

from tokenline import protocol


def encode_pairs(
    hf_tokenizer, requests: list[tuple[int, protocol.Generate]]
) -> dict[int, tuple[list[int], list[int] | None]]:
    """(index, request) to {index: (ids, token type ids)}: one batched call over the pairs.
    (BERT-style encoders read the second text's segment; decoders' tokenizers give none.)"""
    if not requests:
        return {}
    firsts = [r.prompt or "" for _, r in requests]
    seconds = [r.pooling.text_pair for _, r in requests]
    batch = hf_tokenizer(firsts, seconds, add_special_tokens=True)
    types = batch.get("token_type_ids")
    return {
        i: (ids, None if types is None else types[k])
        for k, ((i, _), ids) in enumerate(zip(requests, batch["input_ids"], strict=True))
    }


def check_pooled(
    request: protocol.Generate, ids: list[int], max_model_len: int, types: list[int] | None = None
) -> protocol.Tokenized | protocol.Failed:
    """The tokenized request, or its refusal: empty, or longer than the context."""
    if not ids:
        return protocol.Failed(
            uid=request.uid,
            code="invalid_request_error",
            param="input",
            message="the input is empty after tokenization; send at least one token",
        )
    if len(ids) > max_model_len:
        return protocol.Failed(
            uid=request.uid,
            code="context_length_exceeded",
            param="input",
            message=(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"the input has {len(ids)} tokens. Please reduce the input."
            ),
        )
    return protocol.Tokenized(
        uid=request.uid,
        prompt_ids=ids,
        sampling=request.sampling,
        timeout_s=request.timeout_s,
        pooling=request.pooling,
        token_type_ids=types if types is not None and any(types) else None,
    )
