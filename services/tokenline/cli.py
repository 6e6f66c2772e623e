"""`tokenline serve|api|tokenizer|scheduler|detokenizer|operator|bench|tiny-model`.

Every stage flag has an environment mirror: ``--max-model-len`` ↔ ``TOKENLINE_MAX_MODEL_LEN``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable

from tokenline.protocol import STAGES
from tokenline.settings import Settings
from tokenline.transport import DEFAULT_ENDPOINTS, RingEndpoints

DEFAULT_METRICS_PORTS = {"tokenizer": 8001, "scheduler": 8002, "detokenizer": 8003}


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


def _flag(
    parser: argparse.ArgumentParser,
    name: str,
    kind: Callable = str,
    default=None,
    help: str = "",
    **kwargs,
) -> None:
    env = "TOKENLINE_" + name.upper().replace("-", "_")
    raw = os.environ.get(env)
    # Kubernetes injects service links such as TOKENLINE_PORT=tcp://10.0.0.1:8000 for a
    # Service named "tokenline"; they are not settings.
    if raw and not raw.startswith(("tcp://", "udp://")):
        default = raw  # a string default goes through ``type`` only if the flag is used
    parser.add_argument(
        f"--{name}", type=kind, default=default, help=f"{help} [env {env}]", **kwargs
    )


def _common(parser: argparse.ArgumentParser) -> None:
    _flag(
        parser,
        "model",
        default="tiny",
        help="`tiny` (offline tiny model), a local model directory, or a Hugging Face id",
    )
    _flag(parser, "served-model-name", help="the name clients use (default: the --model value)")
    _flag(parser, "revision", help="Hugging Face revision of --model")
    _flag(parser, "model-cache-dir", help="where `tiny` is built (default ~/.cache/tokenline)")
    _flag(parser, "max-model-len", int, help="context limit (default: the model's)")
    _flag(parser, "log-level", default="info", help="debug, info, warning or error")
    _flag(
        parser,
        "drain-timeout",
        float,
        30.0,
        help="seconds in-flight requests get after SIGTERM before they are aborted",
    )
    for stage in STAGES:
        _flag(
            parser,
            f"{stage}-endpoint",
            default=DEFAULT_ENDPOINTS[stage],
            help=f"ZMQ endpoint the {stage} stage binds (tcp:// or ipc://)",
        )


def _api_flags(parser: argparse.ArgumentParser) -> None:
    _flag(parser, "host", default="0.0.0.0", help="address the HTTP server binds")
    _flag(parser, "port", int, 8000, help="HTTP port (serve: stage metrics on port+1..3)")
    _flag(parser, "request-timeout", float, 600.0, help="per-request deadline, seconds")
    _flag(
        parser,
        "slow-client-timeout",
        float,
        30.0,
        help="seconds a paused stream may stay unread before it is aborted",
    )
    _flag(parser, "max-waiting", int, 256, help="waiting requests before new ones get 429")
    _security_flags(parser)


class _AppendOverEnv(argparse.Action):
    """Repeatable flag whose first use replaces the environment's list instead of adding to it
    (argparse's ``append`` would add to it), as every other flag overrides its mirror."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, self.dest)
        if current is self.default:
            current = []
        setattr(namespace, self.dest, [*current, values])


def _security_flags(parser: argparse.ArgumentParser) -> None:
    env_keys = os.environ.get("TOKENLINE_API_KEY", "")
    parser.add_argument(
        "--api-key",
        dest="api_keys",
        action=_AppendOverEnv,
        default=[k.strip() for k in env_keys.split(",") if k.strip()],
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on every route but /health, /ready and "
        "/metrics; repeat for several keys. Prefer --api-key-file: a command line is visible "
        "to local users [env TOKENLINE_API_KEY, comma-separated]",
    )
    _flag(
        parser,
        "api-key-file",
        help="file of API keys, one per line (# comments and blank lines ignored); re-read "
        "when it changes, so a rotated Kubernetes Secret applies without a restart",
    )
    _flag(
        parser,
        "max-body-size",
        parse_bytes,
        8 * 2**20,
        help="largest request body, e.g. 8MiB; larger ones get 413 before they are read",
    )
    _flag(parser, "max-n", int, 16, help="most choices (`n`) one request may ask for")
    _flag(parser, "max-tokens-limit", int, 131_072, help="largest max_tokens a request may ask for")
    _flag(parser, "max-stop-strings", int, 16, help="most `stop` strings per request")
    _flag(parser, "max-stop-string-length", int, 1024, help="longest `stop` string, characters")
    _flag(parser, "max-stop-token-ids", int, 256, help="most `stop_token_ids` per request")
    _flag(parser, "max-messages", int, 2048, help="most chat `messages` per request")
    _flag(
        parser,
        "max-prompt-chars",
        int,
        2**20,
        help="longest completions prompt, or all chat message contents together, in characters",
    )
    _flag(parser, "max-logprobs", int, 20, help="largest `top_logprobs` (chat) or `logprobs`")


def _scheduler_flags(parser: argparse.ArgumentParser) -> None:
    _flag(parser, "device", default="auto", choices=["auto", "cpu", "cuda"], help="compute device")
    _flag(
        parser,
        "dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV dtype (auto: bf16 on CUDA, fp32 on CPU)",
    )
    _flag(
        parser,
        "kv-cache-memory",
        parse_bytes,
        help="KV cache size, e.g. 8GiB (default: --gpu-memory-utilization of the GPU, "
        "512MiB on CPU)",
    )
    _flag(parser, "gpu-memory-utilization", float, 0.9, help="fraction of GPU memory to use")
    _flag(parser, "max-num-seqs", int, 256, help="most sequences decoded together")
    _flag(
        parser,
        "max-num-batched-tokens",
        int,
        help="token budget of one step; long prompts are prefilled in chunks of it "
        "(default: 2048 on CUDA, 128 on CPU, where small steps measured faster)",
    )
    _flag(parser, "block-size", int, 16, help="tokens per KV cache block")
    _flag(
        parser,
        "torch-threads",
        int,
        help="CPU threads for the model (default: every core but one, which the other stages use)",
    )
    _flag(
        parser,
        "compile",
        parse_bool,
        False,
        nargs="?",
        const=True,
        help="compile each layer's projections, norm and MLP with torch.compile: fewer kernel "
        "launches on a GPU; the first steps wait for compilation (measured no faster on CPU)",
    )
    _flag(
        parser,
        "no-prefix-caching",
        parse_bool,
        False,
        nargs="?",
        const=True,
        help="compute every prompt in full instead of reusing the KV blocks of prefixes "
        "computed before (prefix caching is on by default)",
    )


def settings_from(args: argparse.Namespace) -> Settings:
    values = {
        k: v for k, v in vars(args).items() if k in Settings.__dataclass_fields__ and v is not None
    }
    values["endpoints"] = RingEndpoints(**{s: getattr(args, f"{s}_endpoint") for s in STAGES})
    return Settings(**values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenline", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run all four stages locally as child processes")
    _common(serve)
    _api_flags(serve)
    _scheduler_flags(serve)
    serve.add_argument(
        "--ipc-dir",
        help="directory for the ring's IPC sockets (default: a temporary one, removed on exit)",
    )

    api = sub.add_parser("api", help="the OpenAI-compatible HTTP stage")
    _common(api)
    _api_flags(api)
    # api only: serve's supervisor probes /ready over plain HTTP
    _flag(api, "ssl-certfile", help="PEM certificate (chain): serve HTTPS instead of HTTP")
    _flag(api, "ssl-keyfile", help="PEM private key of --ssl-certfile (if not in that file)")
    for stage in ("tokenizer", "scheduler", "detokenizer"):
        p = sub.add_parser(stage, help=f"the {stage} stage")
        _common(p)
        _flag(p, "metrics-port", int, DEFAULT_METRICS_PORTS[stage], help="Prometheus port")
        if stage == "scheduler":
            _scheduler_flags(p)

    tiny = sub.add_parser("tiny-model", help="write the offline tiny model in HF format")
    tiny.add_argument("--out", required=True, help="directory to write")

    sub.add_parser("operator", help="run the Kubernetes operator (kopf)", add_help=False)
    sub.add_parser("bench", help="OpenAI-compatible load generator", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # operator and bench own their flags
    if argv and argv[0] == "operator":
        from tokenline_operator.cli import main as operator_main

        return operator_main(argv[1:])
    if argv and argv[0] == "bench":
        from tokenline.bench.cli import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "tiny-model":
        from tokenline.tiny_model import build

        print(build(args.out))
        return 0
    from tokenline.lifecycle import setup_logging

    setup_logging(args.command, args.log_level)
    settings = settings_from(args)
    if args.command == "serve":
        from tokenline.serve import serve

        return serve(settings, args.ipc_dir)
    runners = {
        "api": "tokenline.api.app",
        "tokenizer": "tokenline.tokenizer.stage",
        "scheduler": "tokenline.scheduler.stage",
        "detokenizer": "tokenline.detokenizer.stage",
    }
    import importlib

    return importlib.import_module(runners[args.command]).run(settings)


if __name__ == "__main__":
    sys.exit(main())
