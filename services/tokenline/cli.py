"""`tokenline serve|api|tokenizer|scheduler|detokenizer|operator|bench|fetch|tiny-model|ring-keys`.

Every stage flag has an environment mirror: ``--max-model-len`` ↔ ``TOKENLINE_MAX_MODEL_LEN``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Any

from tokenline.settings import (
    BY_FLAG,
    DEFAULT_METRICS_PORTS,
    SETTINGS,
    Setting,
    Settings,
    parse_bool,
    parse_bytes,
    settings_of,
)
from tokenline.settings.vllm_flags import translate
from tokenline.transport import RingEndpoints

# re-exported: callers parse sizes and booleans as the flags do
__all__ = [
    "DEFAULT_METRICS_PORTS",
    "build_parser",
    "main",
    "parse_bool",
    "parse_bytes",
    "settings_from",
]


def _flag(parser: argparse.ArgumentParser, setting: Setting, stage: str) -> None:
    env = setting.env
    raw = os.environ.get(env)
    default = setting.default
    if setting.stage_defaults is not None:
        default = setting.stage_defaults[stage]
    if setting.repeatable:
        parser.add_argument(
            f"--{setting.flag}",
            dest=setting.dest,
            action=_AppendOverEnv,
            nargs="+" if setting.several else None,
            default=[k.strip() for k in (raw or "").split(",") if k.strip()],
            metavar=setting.metavar,
            help=f"{setting.help} [env {env}, comma-separated]",
        )
        return
    # Kubernetes injects service links such as TOKENLINE_PORT=tcp://10.0.0.1:8000 for a
    # Service named "tokenline"; they are not settings.
    if raw and not raw.startswith(("tcp://", "udp://")):
        default = raw  # a string default goes through ``type`` only if the flag is used
    extra: dict[str, Any] = {}
    if setting.choices is not None:
        extra["choices"] = list(setting.choices)
    if setting.switch:
        extra.update(nargs="?", const=True)
    if setting.metavar is not None:
        extra["metavar"] = setting.metavar
    parser.add_argument(
        f"--{setting.flag}",
        dest=setting.dest,
        type=setting.kind,
        default=default,
        help=f"{setting.help} [env {env}]",
        **extra,
    )


class _AppendOverEnv(argparse.Action):
    """Repeatable flag whose first use replaces the environment's list instead of adding to it
    (argparse's ``append`` would add to it), as every other flag overrides its mirror."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, self.dest)
        if current is self.default:
            current = []
        added = values if isinstance(values, list) else [values]  # nargs="+" gives a list
        setattr(namespace, self.dest, [*current, *added])


def add_setting_flags(parser: argparse.ArgumentParser, stage: str) -> None:
    """Every flag of `stage` (``serve`` included), from the declarations in `SETTINGS`."""
    for setting in settings_of(stage):
        _flag(parser, setting, stage)


def settings_from(args: argparse.Namespace) -> Settings:
    values: dict[str, Any] = {}
    endpoints = {}
    for setting in SETTINGS:
        value = getattr(args, setting.dest, None)
        if value is None:
            continue
        if setting.field_name == "endpoints":
            endpoints[setting.attr.split(".")[1]] = value
        else:
            values[setting.field_name] = value
    values["endpoints"] = RingEndpoints(**endpoints)
    tag = getattr(args, "model_tag", None)  # `tokenline serve MODEL`, as `vllm serve MODEL`
    if tag is not None:
        flag = values.get("model")
        if flag not in (None, BY_FLAG["model"].default, tag):
            raise SystemExit(f"serve {tag} --model {flag}: name the model once")
        values["model"] = tag
    return Settings(**values)


# Commands that parse their own flags, each imported only when run: module, help line.
OWN_FLAGS: dict[str, tuple[str, str]] = {
    "operator": ("tokenline_operator.cli", "run the Kubernetes operator (kopf)"),
    "bench": ("tokenline.loadgen.cli", "OpenAI-compatible load generator"),
    "fetch": ("tokenline.fetch", "download a model URI into a directory (the init container)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenline", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run all four stages locally as child processes")
    serve.add_argument(
        "model_tag", nargs="?", metavar="MODEL", help="the model, as `vllm serve MODEL` names it"
    )
    add_setting_flags(serve, "serve")
    serve.add_argument(
        "--ipc-dir",
        help="directory for the ring's IPC sockets (default: a temporary one, removed on exit)",
    )

    api = sub.add_parser("api", help="the OpenAI-compatible HTTP stage")
    add_setting_flags(api, "api")
    for stage in ("tokenizer", "scheduler", "detokenizer"):
        add_setting_flags(sub.add_parser(stage, help=f"the {stage} stage"), stage)

    tiny = sub.add_parser("tiny-model", help="write the offline tiny model in HF format")
    tiny.add_argument("--out", required=True, help="directory to write")
    keys = sub.add_parser("ring-keys", help="write a CurveZMQ certificate for --ring-curve-keys")
    keys.add_argument("--out", required=True, help="directory to write (every stage's keys)")

    for command, (_, help_text) in OWN_FLAGS.items():
        sub.add_parser(command, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in OWN_FLAGS:
        module, _ = OWN_FLAGS[argv[0]]
        return importlib.import_module(module).main(argv[1:])
    argv, said = translate(argv)  # vLLM's flags, as vLLM means them
    args = build_parser().parse_args(argv)
    if args.command == "tiny-model":
        from tokenline.tiny_model import build

        print(build(args.out))
        return 0
    if args.command == "ring-keys":
        from tokenline.ring_security import create_keys

        print(create_keys(args.out))
        return 0
    from tokenline.lifecycle import setup_logging

    setup_logging(args.command, args.log_level)
    for line in said:
        logging.getLogger("tokenline.cli").info("%s", line)
    settings = settings_from(args)
    if args.command == "serve":
        from tokenline.serve import serve

        return serve(settings, args.ipc_dir)
    runners = {
        "api": "tokenline.api.app",
        "tokenizer": "tokenline.tokenizer.stage",
        "scheduler": "tokenline.scheduler.start",
        "detokenizer": "tokenline.detokenizer.stage",
    }
    return importlib.import_module(runners[args.command]).run(settings)


if __name__ == "__main__":
    sys.exit(main())
