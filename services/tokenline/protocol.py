"""Every message that crosses a socket.

Messages travel one way around the ring::

    api ──▶ tokenizer ──▶ scheduler ──▶ detokenizer ──▶ api

Each hop has one tagged union (`ToTokenizer`, `ToScheduler`, `ToDetokenizer`, `ToApi`).
Control messages (`Abort`, `Pause`, `Resume`, `Heartbeat`) ride the same ring behind the
request they refer to, so no stage sees them out of order. Every admitted uid ends with exactly
one terminal `Reply` (``finish_reason`` set) at the api; errors found early travel forward as
`Failed`, so every stage sees the end of every uid it saw the start of. A `TokenizeCall`
(/tokenize, /detokenize) is answered by the tokenizer alone; no stage holds state for it.

Durations are stamped by each stage from its own monotonic clock; wall-clock differences between
processes are never taken.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

PROTOCOL_VERSION = 1

FinishReason = Literal["stop", "length", "abort", "error"]
AbortReason = Literal[
    "client_disconnect", "deadline", "slow_client", "stage_failure", "shutdown", "stop_string"
]
STAGES = ("api", "tokenizer", "scheduler", "detokenizer")


class _Message(msgspec.Struct, tag_field="t", kw_only=True, omit_defaults=True):
    """Base for every wire message; ``t`` carries the type tag."""


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


# ── requests, api → tokenizer → scheduler ─────────────────────────────────────────────────────


class Generate(_Message, tag="generate"):
    """A new request as the api admits it: raw text or chat messages, not yet tokenized."""

    uid: str
    sampling: SamplingParams
    timeout_s: float
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # OpenAI's tool definitions ({"type": "function", "function": {...}}) for the template
    tools: list[dict[str, Any]] | None = None
    # A prompt already tokenized: taken as it is (no special tokens added), checked in vocab
    prompt_ids: list[int] | None = None
    lora: str = ""  # the LoRA adapter that serves it, by name; "" is the base model
    # extra variables of the chat template (enable_thinking, reasoning_effort, ...)
    template_kwargs: dict[str, Any] | None = None
    priority: int = 0  # vLLM's: lower runs earlier (--scheduling-policy priority)
    tenant: str = ""  # whose request it is, for fair share ("" : nobody in particular)
    version: int = PROTOCOL_VERSION


class Tokenized(_Message, tag="tokenized"):
    """A request after the tokenizer: prompt ids plus what the later stages need."""

    uid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    timeout_s: float
    tokenizer_s: float = 0.0  # time the request spent in the tokenizer stage
    lora: str = ""  # as `Generate.lora`
    priority: int = 0  # as `Generate.priority`
    tenant: str = ""  # as `Generate.tenant`


class Abort(_Message, tag="abort"):
    """Cancel a uid. Stages that do not hold it forward it anyway."""

    uid: str
    reason: AbortReason


class Pause(_Message, tag="pause"):
    """Backpressure: take the uid out of the decode batch, keep its KV cache."""

    uid: str


class Resume(_Message, tag="resume"):
    uid: str


class StageStatus(msgspec.Struct, kw_only=True, omit_defaults=True):
    stage: str
    instance: str  # random per process start; a new value means the stage restarted
    ready: bool = True
    waiting: int = 0
    running: int = 0
    # The scheduler's KV cache, for endpoint pickers reading the api port
    kv_usage: float = 0.0  # share of usable blocks referenced, 0-1
    block_size: int = 0  # tokens per block
    num_blocks: int = 0  # usable blocks
    # The scheduler's LoRA adapters, for vllm:lora_requests_info on the api port
    max_loras: int = 0  # adapters resident on the device at once; 0: LoRA is off
    lora_running: list[str] = []  # adapters of running sequences
    lora_waiting: list[str] = []  # adapters of waiting sequences
    lora_adapters: list[str] = []  # every adapter the scheduler can serve now
    # The scheduler's model, for /v1/models, and why it cannot follow a grammar ("" if it can)
    architecture: str = ""
    model_impl: str = ""  # "tokenline" (a native module) or "transformers" (their modules)
    grammar_refusal: str = ""


class Heartbeat(_Message, tag="heartbeat"):
    """Sent by the api around the ring; each stage appends its status and forwards it."""

    seq: int
    origin: str  # the api instance that sent it; other replicas' heartbeats are ignored
    statuses: list[StageStatus] = []


class Failed(_Message, tag="failed"):
    """A terminal error for a uid; travels forward to the api.

    Found early (a bad template, a prompt too long) or by containment: a stage whose handling
    of the uid raised. ``stage`` names the stage that ended it, so the api knows whether stages
    before that one may still hold the uid.
    """

    uid: str
    code: str
    message: str
    param: str | None = None
    http_status: int = 400
    stage: str = ""


class Link(_Message, tag="link"):
    """A stage saw the connection from its upstream peer open or close (a ZMQ socket event).

    A stage that dies drops its connections at once, so its neighbours know within
    milliseconds, long before a heartbeat could time out; the report travels forward to the api.
    """

    reporter: str  # the stage whose inbox saw the event
    peer: str  # the stage upstream of it
    up: bool


# ── calls answered by the tokenizer alone (/tokenize, /detokenize) ─────────────────────────────


class TokenizeCall(_Message, tag="tokenize"):
    """Tokenize a prompt or chat messages, or detokenize ids (``decode``), for the api.

    Nothing is admitted and no stage holds it: the tokenizer answers with a `TokenizerAnswer`
    (or a `Failed`), which the scheduler and the detokenizer pass on to the api.
    """

    uid: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None  # as `Generate.tools`, for the chat template
    decode: list[int] | None = None  # ids to turn back into text instead
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    template_kwargs: dict[str, Any] | None = None  # as `Generate.template_kwargs`


class TokenizerAnswer(_Message, tag="tokenizer_answer"):
    """The tokenizer's answer to a `TokenizeCall`: ids (and their token strings) or text."""

    uid: str
    ids: list[int] = []
    token_strs: list[str] | None = None
    text: str | None = None
    max_model_len: int = 0


# ── LoRA adapters loaded and unloaded at runtime (api → tokenizer → scheduler) ──────────────────


class LoraCall(_Message, tag="lora_call"):
    """Load or unload a LoRA adapter, for the api's /v1/load_lora_adapter and
    /v1/unload_lora_adapter.

    The tokenizer passes it on; the scheduler answers with a `LoraAnswer` (or a `Failed`, with
    vLLM's error codes), which the detokenizer passes on to the api. An unload lets the
    adapter's requests in flight finish first; the answer comes at once.
    """

    uid: str
    action: Literal["load", "unload"]
    name: str
    uri: str = ""  # load: a directory in PEFT format, or any URI model delivery supports


class LoraAnswer(_Message, tag="lora_answer"):
    """The scheduler's answer to a `LoraCall`: the adapters it serves after it."""

    uid: str
    adapters: list[str] = []


# ── scheduler → detokenizer ───────────────────────────────────────────────────────────────────


class Begin(_Message, tag="begin"):
    """The scheduler admitted a uid; tells the detokenizer how to render it."""

    uid: str
    prompt_tokens: int
    stop: list[str] = []
    timeout_s: float = 0.0
    tokenizer_s: float = 0.0
    prompt_tail: list[int] = []  # the prompt's last ids: the detokenizer primes its stream
    reasoning: bool = False  # as `SamplingParams.reasoning`
    # sampling.echo: every prompt id, decoded into the first reply's prompt_text (non-empty
    # exactly when echo was asked; prompt logprobs name their own token ids)
    echo_ids: list[int] = []


class TokenLogprobs(msgspec.Struct, omit_defaults=True, array_like=True):
    """One sampled token's log-probability under the model's raw distribution, with the top
    alternatives (most likely first)."""

    token_id: int
    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class TokenOutput(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True):
    uid: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    queue_s: float = 0.0  # set on the first output: time from arrival to first schedule
    scheduler_s: float = 0.0  # set on the terminal output: time the uid spent in the scheduler
    error_code: str | None = None
    cached_tokens: int = 0  # set on the first output: prompt tokens found in the prefix cache
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the request asked
    # With sampling.prompt_logprobs, on the first output only: one per prompt token, [0] None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class TokenBatch(_Message, tag="tokens"):
    """All outputs of one engine step: one message per step, not per token."""

    outputs: list[TokenOutput]


# ── detokenizer → api ─────────────────────────────────────────────────────────────────────────


class TopLogprob(msgspec.Struct, array_like=True):
    token: str
    logprob: float
    bytes: list[int]


class LogprobEntry(msgspec.Struct, omit_defaults=True, array_like=True):
    """A token as the client sees it: its text, log-probability, UTF-8 bytes, alternatives."""

    token: str
    logprob: float
    bytes: list[int]
    top: list[TopLogprob] = []


class Reply(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True):
    uid: str
    text: str
    num_tokens: int  # tokens behind this piece of text
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    error_code: str | None = None
    error_message: str | None = None
    http_status: int = 0
    stop_string: bool = False  # ended by a stop string: the scheduler still holds the uid
    # stage timings, on the terminal reply only
    tokenizer_s: float = 0.0
    queue_s: float = 0.0
    scheduler_s: float = 0.0
    detokenizer_s: float = 0.0
    cached_tokens: int = 0  # on the terminal reply: prompt tokens served from the prefix cache
    # with sampling.reasoning: the thinking of this piece (``text`` is the answer's), and the
    # tokens behind it, its markers included
    reasoning: str = ""
    reasoning_tokens: int = 0
    logprobs: list[LogprobEntry] | None = None  # per token of this reply, when asked
    prompt_text: str | None = None  # with sampling.echo: the decoded prompt, first reply only
    prompt_logprobs: list[LogprobEntry | None] | None = None  # first reply only; [0] is None


class ReplyBatch(_Message, tag="replies"):
    replies: list[Reply]


ToTokenizer = Generate | TokenizeCall | LoraCall | Abort | Pause | Resume | Heartbeat
ToScheduler = (
    Tokenized | TokenizerAnswer | LoraCall | Failed | Abort | Pause | Resume | Heartbeat | Link
)
ToDetokenizer = (
    Begin | TokenBatch | TokenizerAnswer | LoraAnswer | Failed | Abort | Heartbeat | Link
)
ToApi = ReplyBatch | TokenizerAnswer | LoraAnswer | Failed | Abort | Heartbeat | Link


# ── what a message means for a uid's lifetime (the runtime's ledger and the simulation) ───────


def started_uids(message: msgspec.Struct) -> list[tuple[str, float]]:
    """(uid, timeout) for each uid whose state a stage creates when ``message`` arrives."""
    if isinstance(message, Generate | Tokenized | Begin):
        return [(message.uid, message.timeout_s)]
    return []


def ended_uids(message: msgspec.Struct) -> list[str]:
    """Uids that ``message``, sent onward, ends: no stage before it holds them any longer."""
    if isinstance(message, Failed | Abort | TokenizerAnswer | LoraAnswer):
        return [message.uid]
    if isinstance(message, TokenBatch):
        return [o.uid for o in message.outputs if o.finish_reason is not None]
    if isinstance(message, ReplyBatch):
        return [r.uid for r in message.replies if r.finish_reason is not None]
    return []


def released_uids(message: msgspec.Struct) -> list[str]:
    """Uids the sending stage lets go of by sending ``message``: their end, or a hand-off."""
    if isinstance(message, Tokenized):
        return [message.uid]
    return ended_uids(message)


def uids_of(message: msgspec.Struct) -> list[str]:
    """Every uid a message concerns."""
    if isinstance(message, TokenBatch):
        return [o.uid for o in message.outputs]
    if isinstance(message, ReplyBatch):
        return [r.uid for r in message.replies]
    uid = getattr(message, "uid", None)
    return [uid] if uid is not None else []


class Codec:
    """MessagePack encoder/decoder for one direction of the ring."""

    def __init__(self, union: object) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(union)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, frame: bytes) -> msgspec.Struct:
        """Raise `msgspec.DecodeError` (a `ValueError`) on a malformed frame."""
        return self._decoder.decode(frame)
