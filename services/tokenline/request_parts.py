"""What a request carries through the ring beside its uid: its sampling parameters, its chat
messages (with the tool calls of earlier turns) and, for a pooling model, what to pool. Plain
structs, no tags: the messages of protocol.py hold them."""

from __future__ import annotations

from typing import Literal

import msgspec


class KVTransferParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's ``kv_transfer_params`` (NixlConnector's keys), as llm-d's routing sidecar sends
    them: ``do_remote_decode`` asks a prefill pod to compute the prompt and keep its KV for a
    decode pod; ``do_remote_prefill`` (with the ``remote_*`` fields the prefill pod answered)
    asks a decode pod to read that KV instead of computing it (scheduler/kv_transfer/)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    # null in the sidecar's prefill request, as vLLM's connector writes them
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int = 1
    # wall-clock time (epoch s) the prefill pod keeps the blocks until: no read starts later
    remote_blocks_expiry_time: float | None = None


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    max_tokens: int | None = None  # None: up to the context limit (the tokenizer fills it in)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None  # None: not wanted; N: the chosen token's plus the top N
    logit_bias: dict[int, float] = {}  # token id -> bias added to its logit before sampling
    grammar: str | None = None  # an llguidance grammar the output must match (api builds it)
    prompt_logprobs: int | None = None  # echo: the prompt tokens' logprobs plus the top N
    echo: bool = False  # send the prompt's text back in the first reply
    reasoning: bool = False  # chat: the detokenizer keeps thinking apart (--reasoning-parser)
    # False: special tokens stay in the text (a tool format whose markers are special tokens)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM's: a stop string (or token) ends the text
    kv_transfer: KVTransferParams | None = None  # prefill/decode disaggregation (llm-d's)


class ToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A call an assistant message made, as the client sent it back in the conversation."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI carries it; the tokenizer parses it for the template


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str  # system, user, assistant or tool
    content: str  # the text parts joined with a newline, when sent as parts
    # The text parts as sent (None: content came as a string; []: it came as null), for
    # templates that read parts (--chat-template-content-format openai)
    parts: list[str] | None = None
    tool_calls: list[ToolCall] = []  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    name: str | None = None  # a tool turn: the function that answered
    reasoning: str | None = None  # an assistant turn's thinking, for templates that show it


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A pooling request (--runner pooling): what the scheduler pools and hands back instead
    of generating. ``embed``: one vector (the model's pooling, normalised as it asks, cut to
    ``dimensions`` first when set, Matryoshka-style); ``classify``: the head's raw logits."""

    task: Literal["embed", "classify"] = "embed"
    dimensions: int | None = None
    # a cross-encoder's second text: the tokenizer encodes (prompt, text_pair) as one pair
    text_pair: str | None = None
