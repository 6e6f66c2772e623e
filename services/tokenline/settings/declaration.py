"""Every setting of the stage commands, declared once in `SETTINGS`.

A declaration names the flag, its parser, default and help, the stages that take it, and the
field of the operator's CRD that sets it. Everything else is derived from it: the `Settings`
dataclass the stages read (its fields, types and defaults), every stage's flags and their
TOKENLINE_* mirrors (`cli.py`), each child's command line under `tokenline serve`
(`serve.py`), the CRD's schema of each setting's field and the pod's ConfigMap (the operator's
`crd_schema.py` and `config.py`) and so the chart's CRD and values schema. Tests under
tests/test_settings_declared_once.py and tests/operator fail when a surface drifts from it.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, make_dataclass
from typing import Any

from tokenline.protocol import STAGES
from tokenline.ring_security import RingSecurity
from tokenline.transport import DEFAULT_ENDPOINTS, RingEndpoints

_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def parse_bytes(value: str) -> int:
    """``8GiB``, ``512MiB``, ``1.5G`` or plain bytes."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]i?)?b?\s*", value.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"{value!r} is not a size; use e.g. 512MiB or 8GiB")
    return int(float(match[1]) * _UNITS[match[2] or ""])


def parse_bool(value: str | bool) -> bool:
    """``--compile``, ``--compile false``, ``TOKENLINE_COMPILE=1``."""
    if isinstance(value, bool):
        return value
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"{value!r} is not a boolean; use true or false")


ALL_STAGES = frozenset(STAGES)
API = frozenset({"api"})
SCHEDULER = frozenset({"scheduler"})
BEHIND_API = frozenset(STAGES) - API  # the stages behind the api, each with its metrics port


@dataclass(frozen=True)
class CrdField:
    """Where an InferenceService sets a setting: ``spec.<path>``, through the pod's ConfigMap.

    The field's schema takes its type, enum and default from the setting; this adds the
    description and the bounds the API server checks.
    """

    path: str
    help: str
    #: OpenAPI keywords beyond type, enum and default (bounds, patterns), or a type of its own
    schema: Mapping[str, Any] = field(default_factory=dict)
    #: the field says what the switch turns off (``prefixCaching`` for ``--no-prefix-caching``)
    inverted: bool = False
    #: required, without the flag's default (``model.name``)
    required: bool = False
    #: a field of the same section that may be set instead of this required one: exactly one
    #: of the two (``model.uri`` for ``model.name``)
    alternative: str = ""
    #: a switch's ConfigMap value when on; kept as first written, as a changed value rolls pods
    on: str = "true"

    @property
    def section(self) -> str:
        return self.path.split(".")[0]

    @property
    def name(self) -> str:
        return self.path.split(".")[1]


@dataclass(frozen=True)
class Setting:
    """One setting: its flag, parser, default and help, who takes it, and where it is set."""

    flag: str
    kind: Callable[[str], Any] = str
    default: Any = None
    help: str = ""
    #: the stage subcommands whose parser has the flag
    stages: frozenset[str] = ALL_STAGES
    #: whether `tokenline serve` has the flag too (it passes it on to `stages`)
    serve: bool = True
    #: the `Settings` attribute; ``endpoints.api`` is a field of ``Settings.endpoints``
    attr: str = ""
    #: the operator CRD's ``spec`` field that sets it (through the pod's ConfigMap), if any
    crd: CrdField | None = None
    choices: tuple[str, ...] | None = None
    #: ``--compile`` alone means true; `serve` passes it only when true
    switch: bool = False
    #: repeatable (``--api-key A --api-key B``); its mirror is comma-separated
    repeatable: bool = False
    metavar: str | None = None
    #: a default of each stage's own, instead of `default`
    stage_defaults: Mapping[str, Any] | None = None
    #: a credential: `serve` hands it to its children in their environment (the mirror),
    #: never on a command line, which every local user can read in ``ps``
    secret: bool = False

    @property
    def env(self) -> str:
        return "TOKENLINE_" + self.flag.upper().replace("-", "_")

    @property
    def field_name(self) -> str:
        """The `Settings` field (``endpoints`` for the four endpoint flags)."""
        return (self.attr or self.flag.replace("-", "_")).split(".")[0]

    @property
    def dest(self) -> str:
        """The argparse attribute the flag is parsed into."""
        return self.attr if self.attr and "." not in self.attr else self.flag.replace("-", "_")

    @property
    def annotation(self) -> Any:
        """The type of its `Settings` field."""
        if self.repeatable:
            return list[str]
        kind = _TYPES.get(self.kind, self.kind)
        return kind if self.default is not None else kind | None

    def value(self, settings: Settings) -> Any:
        value: Any = settings
        for part in (self.attr or self.flag.replace("-", "_")).split("."):
            value = getattr(value, part)
        return value


_TYPES: dict[Callable[[str], Any], type] = {parse_bool: bool, parse_bytes: int}

#: A browser origin as the Origin header spells it (`scheme://host[:port]`: lower case, no
#: path, no trailing slash), or `*`; anything else never equals a request's Origin.
ORIGIN_PATTERN = (
    r"^(\*|[a-z][a-z0-9+.-]*://"
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*|\[[0-9a-f:.]+\])"
    r"(:[0-9]{1,5})?)$"
)
#: Most origins the CRD allows (the list is compared per request).
MAX_ALLOWED_ORIGINS = 64

DEFAULT_METRICS_PORTS = {"tokenizer": 8001, "scheduler": 8002, "detokenizer": 8003}

SETTINGS: tuple[Setting, ...] = (
    # --- every stage -------------------------------------------------------------------
    Setting(
        "model",
        default="tiny",
        help="`tiny` (offline tiny model), a local model directory, or a Hugging Face id",
        crd=CrdField(
            "model.name",
            "`tiny` (the offline tiny model), a directory inside the pod, or a Hugging Face id "
            "that every stage downloads at start. Set exactly one of `name` and `uri`.",
            {"minLength": 1},
            required=True,
            alternative="uri",
        ),
    ),
    Setting(
        "served-model-name",
        help="the name clients use (default: the --model value)",
        crd=CrdField(
            "model.servedName",
            "The name /v1/models lists and requests use; defaults to `name`.",
            {"minLength": 1},
        ),
    ),
    Setting(
        "revision",
        help="Hugging Face revision of --model",
        crd=CrdField(
            "model.revision", "A Hugging Face revision: branch, tag or commit.", {"minLength": 1}
        ),
    ),
    Setting("model-cache-dir", help="where `tiny` is built (default ~/.cache/tokenline)"),
    Setting(
        "log-level",
        default="info",
        help="debug, info, warning or error",
        crd=CrdField(
            "server.logLevel",
            "Log level of every stage.",
            # the flag takes any of Python's level names; the CRD the four documented
            {"enum": ["debug", "info", "warning", "error"]},
        ),
    ),
    Setting(
        "max-model-len",
        int,
        help="context limit (default: the model's)",
        crd=CrdField(
            "engine.maxModelLen",
            "Longest prompt plus completion, in tokens; defaults to the model's own limit.",
            {"minimum": 1},
        ),
    ),
    Setting(
        "drain-timeout",
        float,
        30.0,
        help="seconds in-flight requests get after SIGTERM before they are aborted",
        crd=CrdField(
            "server.drainTimeoutSeconds",
            "How long in-flight requests get after SIGTERM.",
            {"type": "integer", "minimum": 0},
        ),
    ),
    *(
        Setting(
            f"{stage}-endpoint",
            default=DEFAULT_ENDPOINTS[stage],
            help=f"ZMQ endpoint the {stage} stage binds (tcp:// or ipc://)",
            attr=f"endpoints.{stage}",
        )
        for stage in STAGES
    ),
    Setting(
        "ring-curve-keys",
        help="directory of the ring's CurveZMQ certificate and the public keys allowed to "
        "connect (`tokenline ring-keys --out DIR`): every ring socket is encrypted and "
        "authenticated; needed for an endpoint beyond loopback or IPC",
    ),
    Setting(
        "allow-insecure-ring",
        parse_bool,
        False,
        help="start even though a ring endpoint beyond loopback or IPC is neither encrypted "
        "nor authenticated (logged at every start)",
        switch=True,
    ),
    # --- api -------------------------------------------------------------------------------
    Setting("host", default="0.0.0.0", help="address the HTTP server binds", stages=API),
    Setting("port", int, 8000, help="HTTP port (serve: stage metrics on port+1..3)", stages=API),
    Setting(
        "request-timeout",
        float,
        600.0,
        help="per-request deadline, seconds",
        stages=API,
        crd=CrdField(
            "server.requestTimeoutSeconds",
            "Per-request deadline.",
            {"type": "integer", "minimum": 1},
        ),
    ),
    Setting(
        "slow-client-timeout",
        float,
        30.0,
        help="seconds a paused stream may stay unread before it is aborted",
        stages=API,
        crd=CrdField(
            "server.slowClientTimeoutSeconds",
            "How long a paused stream may stay unread before it is aborted.",
            {"type": "integer", "minimum": 1},
        ),
    ),
    Setting(
        "max-waiting",
        int,
        256,
        help="waiting requests before new ones get 429",
        stages=API,
        crd=CrdField(
            "server.maxWaiting", "Waiting requests before the API answers 429/503.", {"minimum": 0}
        ),
    ),
    Setting(
        "api-key",
        help="require `Authorization: Bearer KEY` on every route but /health, /ready and "
        "/metrics; repeat for several keys. Prefer --api-key-file: a command line is visible "
        "to local users",
        stages=API,
        attr="api_keys",
        repeatable=True,
        metavar="KEY",
        secret=True,
    ),
    Setting(
        "allowed-origin",
        help="a browser origin (https://app.example.com, or * for any) whose pages may call "
        "the api: answers CORS preflights and adds Access-Control-Allow-* headers; repeat for "
        "several. Off by default",
        stages=API,
        attr="allowed_origins",
        repeatable=True,
        metavar="ORIGIN",
        crd=CrdField(
            "server.allowedOrigins",
            "Browser origins whose pages may call the API (CORS), e.g. "
            "https://app.example.com, or * for any; unset or empty: no CORS headers. "
            "Write each as the browser sends it: lower case, no path or trailing slash, "
            "no default port.",
            {
                "maxItems": MAX_ALLOWED_ORIGINS,
                "items": {
                    "type": "string",
                    "description": "An origin, scheme://host[:port], or *.",
                    "pattern": ORIGIN_PATTERN,
                },
            },
        ),
    ),
    Setting(
        "api-key-file",
        help="file of API keys, one per line (# comments and blank lines ignored); re-read "
        "when it changes, so a rotated Kubernetes Secret applies without a restart",
        stages=API,
    ),
    Setting(
        "max-body-size",
        parse_bytes,
        8 * 2**20,
        help="largest request body, e.g. 8MiB; larger ones get 413 before they are read",
        stages=API,
    ),
    Setting("max-n", int, 16, help="most choices (`n`) one request may ask for", stages=API),
    Setting(
        "max-tokens-limit",
        int,
        131_072,
        help="largest max_tokens a request may ask for",
        stages=API,
    ),
    Setting("max-stop-strings", int, 16, help="most `stop` strings per request", stages=API),
    Setting(
        "max-stop-string-length", int, 1024, help="longest `stop` string, characters", stages=API
    ),
    Setting("max-stop-token-ids", int, 256, help="most `stop_token_ids` per request", stages=API),
    Setting("max-messages", int, 2048, help="most chat `messages` per request", stages=API),
    Setting(
        "max-prompt-chars",
        int,
        2**20,
        help="longest completions prompt, or all chat message contents together, in characters",
        stages=API,
    ),
    Setting(
        "max-logprobs",
        int,
        20,
        help="largest `top_logprobs` (chat) or `logprobs`",
        stages=API,
    ),
    Setting(
        "tool-call-parser",
        default="auto",
        help="the tool-call format the model writes, which `tools` replies are parsed in and "
        "`tool_choice` required or named constrains to: hermes (<tool_call> JSON, Qwen), "
        "llama3_json, or auto: read from the chat template (hermes when it shows neither)",
        stages=API,
        choices=("auto", "hermes", "llama3_json"),
    ),
    # api only: serve's supervisor probes /ready over plain HTTP
    Setting(
        "ssl-certfile",
        help="PEM certificate (chain): serve HTTPS instead of HTTP",
        stages=API,
        serve=False,
    ),
    Setting(
        "ssl-keyfile",
        help="PEM private key of --ssl-certfile (if not in that file)",
        stages=API,
        serve=False,
    ),
    # --- the stages behind the api ---------------------------------------------------------
    Setting(
        "metrics-port",
        int,
        0,  # the api's: no separate metrics server (it serves /metrics itself)
        help="Prometheus port",
        stages=BEHIND_API,
        serve=False,  # serve gives the stages port+1..3
        stage_defaults=DEFAULT_METRICS_PORTS,
    ),
    # --- scheduler -------------------------------------------------------------------------
    Setting(
        "device",
        default="auto",
        help="compute device",
        stages=SCHEDULER,
        crd=CrdField("engine.device", "Where the model runs."),
        choices=("auto", "cpu", "cuda"),
    ),
    Setting(
        "dtype",
        default="auto",
        help="weights and KV dtype (auto: bf16 on CUDA, fp32 on CPU)",
        stages=SCHEDULER,
        crd=CrdField("engine.dtype", "Weights' data type."),
        choices=("auto", "float32", "bfloat16", "float16"),
    ),
    Setting(
        "kv-cache-memory",
        parse_bytes,
        help="KV cache size, e.g. 8GiB (default: --gpu-memory-utilization of the GPU, "
        "512MiB on CPU)",
        stages=SCHEDULER,
        crd=CrdField(
            "engine.kvCacheMemory",
            "KV cache budget in bytes, e.g. 8GiB; defaults to what gpuMemoryUtilization leaves.",
        ),
    ),
    Setting(
        "gpu-memory-utilization",
        float,
        0.9,
        help="fraction of GPU memory to use",
        stages=SCHEDULER,
        crd=CrdField(
            "engine.gpuMemoryUtilization",
            "Fraction of GPU memory the runner may use.",
            {"minimum": 0.05, "maximum": 1},
        ),
    ),
    Setting(
        "max-num-seqs",
        int,
        256,
        help="most sequences decoded together",
        stages=SCHEDULER,
        crd=CrdField("engine.maxNumSeqs", "Sequences decoded together at most.", {"minimum": 1}),
    ),
    Setting(
        "max-num-batched-tokens",
        int,
        help="token budget of one step; long prompts are prefilled in chunks of it "
        "(default: 2048 on CUDA, 128 on CPU, where small steps measured faster)",
        stages=SCHEDULER,
        crd=CrdField(
            "engine.maxNumBatchedTokens",
            "Tokens one forward step may hold at most; defaults to the scheduler's own for its "
            "device: 2048 on a GPU, 128 on CPU.",
            {"minimum": 1},
        ),
    ),
    Setting("block-size", int, 16, help="tokens per KV cache block", stages=SCHEDULER),
    Setting(
        "torch-threads",
        int,
        help="CPU threads for the model (default: every core but one, which the other stages use)",
        stages=SCHEDULER,
    ),
    Setting(
        "compile",
        parse_bool,
        False,
        help="compile each layer's projections, norm and MLP with torch.compile: fewer kernel "
        "launches on a GPU; the first steps wait for compilation (measured no faster on CPU)",
        stages=SCHEDULER,
        crd=CrdField(
            "engine.compile",
            "torch.compile each layer's projections, norm and MLP (fewer kernel launches on a "
            "GPU); the first steps wait for compilation.",
        ),
        switch=True,
    ),
    Setting(
        "no-prefix-caching",
        parse_bool,
        False,
        help="compute every prompt in full instead of reusing the KV blocks of prefixes "
        "computed before (prefix caching is on by default)",
        stages=SCHEDULER,
        crd=CrdField(
            "engine.prefixCaching",
            "Keep the KV of computed prompt prefixes and reuse it for prompts that start the "
            "same way (system prompts, conversations, tool definitions).",
            inverted=True,
            on="1",
        ),
        switch=True,
    ),
    Setting(
        "prefix-caching-hash-algo",
        default="blake2b",
        help="how KV blocks are named: blake2b (tokenline's), or sha256_cbor (vLLM's, seeded by "
        "PYTHONHASHSEED) so a router that hashes prompts itself, like llm-d's, finds them",
        stages=SCHEDULER,
        crd=CrdField(
            "engine.prefixCachingHashAlgo",
            "How KV blocks are named: blake2b (tokenline's) or sha256_cbor (vLLM's, seeded by "
            "router.kvEvents.hashSeed as PYTHONHASHSEED), which llm-d's precise prefix-cache "
            "scorer needs, as it hashes prompts itself. Unset: sha256_cbor with "
            "router.kvEvents enabled, else blake2b.",
            # no default in the CRD: the operator derives it from router.kvEvents
            {"default": None},
        ),
        choices=("blake2b", "sha256_cbor"),
    ),
    # --- KV-cache events (vLLM's --kv-events-config: publisher zmq) -------------------------
    Setting(
        "kv-events-endpoint",
        help="publish KV-cache events in vLLM's format on this ZMQ endpoint: bound when its "
        "host is * (tcp://*:5557), else connected to (a central subscriber). Off by default",
        stages=SCHEDULER,
    ),
    Setting(
        "kv-events-replay-endpoint",
        help="ZMQ ROUTER endpoint that answers a subscriber's 'events since sequence N' "
        "(tcp://*:5558); off by default",
        stages=SCHEDULER,
    ),
    Setting(
        "kv-events-topic",
        help="topic of every event message (default kv@<POD_IP or host name>@<served model "
        "name>, as llm-d expects)",
        stages=SCHEDULER,
    ),
    Setting(
        "kv-events-hwm",
        int,
        100_000,
        help="high-water mark of a subscriber's queue, in batches: past it batches are "
        "dropped (counted, a sequence gap the subscriber can replay)",
        stages=SCHEDULER,
    ),
    Setting(
        "kv-events-buffer-steps",
        int,
        10_000,
        help="event batches kept for replay",
        stages=SCHEDULER,
    ),
)

BY_FLAG: dict[str, Setting] = {s.flag: s for s in SETTINGS}


def settings_of(stage: str) -> tuple[Setting, ...]:
    """The settings a stage's parser takes, in declaration order; ``serve`` for `serve`'s."""
    if stage == "serve":
        return tuple(s for s in SETTINGS if s.serve)
    return tuple(s for s in SETTINGS if stage in s.stages)


def _field(setting: Setting) -> tuple[str, Any, Any]:
    if setting.repeatable:
        default = field(default_factory=list, repr=not setting.secret)  # never in a log line
    else:
        default = field(default=setting.default, repr=not setting.secret)
    return setting.field_name, setting.annotation, default


def _ring_security(self: Settings) -> RingSecurity:
    return RingSecurity(self.ring_curve_keys, self.allow_insecure_ring)


def _model_name(self: Settings) -> str:
    """The name clients use and /v1/models lists."""
    return self.served_model_name or self.model


def _settings_fields() -> list[tuple[str, Any, Any]]:
    fields = []
    for setting in SETTINGS:
        if setting.field_name != "endpoints":
            fields.append(_field(setting))
        elif not any(name == "endpoints" for name, _, _ in fields):
            fields.append(("endpoints", RingEndpoints, field(default_factory=RingEndpoints)))
    return fields


#: What every stage reads: one field per declaration (the four endpoints in one
#: `RingEndpoints`), with its type and default, in the order of `SETTINGS`.
Settings = make_dataclass(
    "Settings",
    _settings_fields(),
    namespace={
        "__module__": __name__,
        "__doc__": "The settings of one process, one field per declaration in `SETTINGS`.",
        "ring_security": property(_ring_security),
        "model_name": property(_model_name),
    },
)
