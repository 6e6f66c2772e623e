"""Settings shared by the stage commands, each declared once in `SETTINGS`.

A declaration names the flag, its parser, default and help, the stages that take it and the
field of the operator's CRD that sets it. `cli.py` builds every stage's flags from it (each with
its TOKENLINE_* environment mirror), `serve.py` builds each stage child's command line from it,
and tests/test_settings_declared_once.py fails when `Settings`, a parser, `serve` or the
operator drifts from it.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenline.protocol import STAGES
from tokenline.ring_security import RingSecurity
from tokenline.transport import DEFAULT_ENDPOINTS, RingEndpoints


@dataclass
class Settings:
    model: str = "tiny"
    served_model_name: str | None = None
    revision: str | None = None
    model_cache_dir: str | None = None
    endpoints: RingEndpoints = field(default_factory=RingEndpoints)
    metrics_port: int = 0  # 0: no separate metrics server (the api serves /metrics itself)
    log_level: str = "info"
    max_model_len: int | None = None
    # api
    host: str = "0.0.0.0"
    port: int = 8000
    request_timeout: float = 600.0
    slow_client_timeout: float = 30.0
    drain_timeout: float = 30.0
    max_waiting: int = 256
    # api security: keys, TLS, and limits checked before anything is queued (api/limits.py)
    api_keys: list[str] = field(default_factory=list, repr=False)  # never in a log line
    api_key_file: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    max_body_size: int = 8 * 2**20  # bytes
    max_n: int = 16
    max_tokens_limit: int = 131_072
    max_stop_strings: int = 16
    max_stop_string_length: int = 1024  # characters
    max_stop_token_ids: int = 256
    max_messages: int = 2048
    max_prompt_chars: int = 2**20  # a completions prompt, or all of a chat's message contents
    max_logprobs: int = 20
    tool_call_parser: str = "auto"  # the model's tool-call format; auto: from its chat template
    allowed_origins: list[str] = field(default_factory=list)  # CORS; empty: no CORS headers
    # scheduler
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 2048 on CUDA, 128 on CPU
    block_size: int = 16
    torch_threads: int | None = None  # CPU only; None: every core but one
    compile: bool = False  # torch.compile the layers' dense tail (for GPUs)
    no_prefix_caching: bool = False  # prefix caching is on unless this is set
    # the ring beyond loopback and IPC (ring_security.py)
    ring_curve_keys: str | None = None
    allow_insecure_ring: bool = False

    @property
    def ring_security(self) -> RingSecurity:
        return RingSecurity(self.ring_curve_keys, self.allow_insecure_ring)

    @property
    def model_name(self) -> str:
        """The name clients use and /v1/models lists."""
        return self.served_model_name or self.model


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
ENGINE_STAGES = frozenset(STAGES) - API  # the stages `serve` runs beside the api


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
    crd: str | None = None
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

    def value(self, settings: Settings) -> Any:
        value: Any = settings
        for part in (self.attr or self.flag.replace("-", "_")).split("."):
            value = getattr(value, part)
        return value


DEFAULT_METRICS_PORTS = {"tokenizer": 8001, "scheduler": 8002, "detokenizer": 8003}

SETTINGS: tuple[Setting, ...] = (
    # --- every stage -------------------------------------------------------------------
    Setting(
        "model",
        default="tiny",
        help="`tiny` (offline tiny model), a local model directory, or a Hugging Face id",
        crd="model.name",
    ),
    Setting(
        "served-model-name",
        help="the name clients use (default: the --model value)",
        crd="model.servedName",
    ),
    Setting("revision", help="Hugging Face revision of --model", crd="model.revision"),
    Setting("model-cache-dir", help="where `tiny` is built (default ~/.cache/tokenline)"),
    Setting(
        "max-model-len", int, help="context limit (default: the model's)", crd="engine.maxModelLen"
    ),
    Setting(
        "log-level",
        default="info",
        help="debug, info, warning or error",
        crd="server.logLevel",
    ),
    Setting(
        "drain-timeout",
        float,
        30.0,
        help="seconds in-flight requests get after SIGTERM before they are aborted",
        crd="server.drainTimeoutSeconds",
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
        crd="server.requestTimeoutSeconds",
    ),
    Setting(
        "slow-client-timeout",
        float,
        30.0,
        help="seconds a paused stream may stay unread before it is aborted",
        stages=API,
        crd="server.slowClientTimeoutSeconds",
    ),
    Setting(
        "max-waiting",
        int,
        256,
        help="waiting requests before new ones get 429",
        stages=API,
        crd="server.maxWaiting",
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
        crd="server.allowedOrigins",
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
    # --- the engine stages -----------------------------------------------------------------
    Setting(
        "metrics-port",
        int,
        help="Prometheus port",
        stages=ENGINE_STAGES,
        serve=False,  # serve gives the stages port+1..3
        stage_defaults=DEFAULT_METRICS_PORTS,
    ),
    # --- scheduler -------------------------------------------------------------------------
    Setting(
        "device",
        default="auto",
        help="compute device",
        stages=SCHEDULER,
        crd="engine.device",
        choices=("auto", "cpu", "cuda"),
    ),
    Setting(
        "dtype",
        default="auto",
        help="weights and KV dtype (auto: bf16 on CUDA, fp32 on CPU)",
        stages=SCHEDULER,
        crd="engine.dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
    ),
    Setting(
        "kv-cache-memory",
        parse_bytes,
        help="KV cache size, e.g. 8GiB (default: --gpu-memory-utilization of the GPU, "
        "512MiB on CPU)",
        stages=SCHEDULER,
        crd="engine.kvCacheMemory",
    ),
    Setting(
        "gpu-memory-utilization",
        float,
        0.9,
        help="fraction of GPU memory to use",
        stages=SCHEDULER,
        crd="engine.gpuMemoryUtilization",
    ),
    Setting(
        "max-num-seqs",
        int,
        256,
        help="most sequences decoded together",
        stages=SCHEDULER,
        crd="engine.maxNumSeqs",
    ),
    Setting(
        "max-num-batched-tokens",
        int,
        help="token budget of one step; long prompts are prefilled in chunks of it "
        "(default: 2048 on CUDA, 128 on CPU, where small steps measured faster)",
        stages=SCHEDULER,
        crd="engine.maxNumBatchedTokens",
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
        crd="engine.compile",
        switch=True,
    ),
    Setting(
        "no-prefix-caching",
        parse_bool,
        False,
        help="compute every prompt in full instead of reusing the KV blocks of prefixes "
        "computed before (prefix caching is on by default)",
        stages=SCHEDULER,
        crd="engine.prefixCaching",  # inverted: the CRD says what is on
        switch=True,
    ),
)

BY_FLAG: dict[str, Setting] = {s.flag: s for s in SETTINGS}


def settings_of(stage: str) -> tuple[Setting, ...]:
    """The settings a stage's parser takes, in declaration order; ``serve`` for `serve`'s."""
    if stage == "serve":
        return tuple(s for s in SETTINGS if s.serve)
    return tuple(s for s in SETTINGS if stage in s.stages)
