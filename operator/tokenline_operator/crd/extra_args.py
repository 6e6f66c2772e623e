"""``spec.engine.extraArgs``: a deployment's ``vllm serve`` (or tokenline) flags, carried over.

They go through the parser the stages themselves use (vLLM's flags translated as
`tokenline serve` translates them, then the declared settings' flags) before any pod is made,
so a flag the stages would refuse is a Degraded condition with the parser's own words, never a
pod that crash-loops. Flags the spec has a field for, or that the pod sets itself (its ring,
ports, mounted files), are refused with what to set instead: two sources for one setting
would leave the status reporting one and the pods running the other. Each container gets the
flags its stage takes (`stage_args`), as `tokenline serve` hands them out.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from tokenline.cli import add_setting_flags
from tokenline.settings import BY_FLAG
from tokenline.settings.vllm_flags import translate

#: Flags the pod sets itself, and what sets the thing instead.
POD_SETS: dict[str, str] = {
    **dict.fromkeys(
        ("api-endpoint", "tokenizer-endpoint", "scheduler-endpoint", "detokenizer-endpoint"),
        "the pod's stages talk over IPC sockets of their own",
    ),
    **dict.fromkeys(("ring-curve-keys", "allow-insecure-ring"), "the ring never leaves the pod"),
    **dict.fromkeys(
        ("host", "port", "metrics-port"), "the pod's ports are fixed; see spec.service"
    ),
    "model-cache-dir": "set spec.model.cache",
    **dict.fromkeys(("api-key", "api-key-file"), "set spec.server.apiKeySecret"),
    **dict.fromkeys(("ssl-certfile", "ssl-keyfile"), "set spec.server.tlsSecret"),
    **dict.fromkeys(
        ("node-rank", "master-addr", "master-port"), "set spec.engine.nodes, which places ranks"
    ),
    **dict.fromkeys(
        ("kv-events-endpoint", "kv-events-replay-endpoint"), "set spec.router.kvEvents"
    ),
    **dict.fromkeys(
        (
            "enable-lora",
            "lora-modules",
            "lora-config",
            "max-loras",
            "max-lora-rank",
            "max-cpu-loras",
        ),
        "set spec.model.lora (its adapters, maxAdapters and maxRank)",
    ),
}


class _Refused(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    """The stages' flags, with errors raised instead of printed and exited on."""

    def error(self, message: str):  # type: ignore[override]
        raise _Refused(message)


def _parser() -> _Parser:
    parser = _Parser(prog="spec.engine.extraArgs", allow_abbrev=False, add_help=False)
    add_setting_flags(parser, "serve")  # every stage's flags but those the pod sets
    return parser


def _flag_name(token: str) -> str | None:
    """``max-loras`` for ``--max-loras`` or ``--max-loras=2``; None for a value."""
    return token[2:].partition("=")[0] if token.startswith("--") else None


def _translated(args: Sequence[str]) -> list[str]:
    try:
        translated, _said = translate(list(args))
    except SystemExit as exc:  # a vLLM flag tokenline has no such thing for
        raise _Refused(str(exc)) from None
    return translated


def problems(args: Sequence[str], served_name: str) -> list[str]:
    """Why the stages would refuse ``args`` (none: they run with them). ``served_name`` is the
    name the status reports, which ``--served-model-name`` must keep first."""
    try:
        translated = _translated(args)
    except _Refused as exc:
        return [f"spec.engine.extraArgs: {exc}"]
    found = []
    for index, token in enumerate(translated):
        name = _flag_name(token)
        setting = BY_FLAG.get(name or "")
        if setting is None:
            continue  # a value, or a flag the parser refuses below
        if name == "served-model-name":
            first = token.partition("=")[2] or next(iter(translated[index + 1 : index + 2]), "")
            if first != served_name:
                found.append(
                    f"--served-model-name: the first name must be {served_name!r} (the model's "
                    "served name, which the status reports; set spec.model.servedName); the "
                    "names after it are aliases"
                )
        elif name in POD_SETS:
            found.append(f"--{name}: set by the operator; {POD_SETS[name]}")
        elif setting.crd is not None:
            found.append(f"--{name}: set spec.{setting.crd.path} instead")
    if not found:
        try:
            _parser().parse_args(translated)
        except _Refused as exc:
            found.append(str(exc))
    return [f"spec.engine.extraArgs: {problem}" for problem in found]


def _chunks(translated: Sequence[str]) -> list[list[str]]:
    """The flags one by one, each with the values after it (the parser read them so)."""
    chunks: list[list[str]] = []
    for token in translated:
        if _flag_name(token) is not None or not chunks:
            chunks.append([token])
        else:
            chunks[-1].append(token)
    return chunks


def stage_args(args: Sequence[str], stage: str) -> list[str]:
    """The flags of ``args`` that ``stage`` takes, in tokenline's names; ``args`` passed
    `problems` (a refused vLLM flag raises here)."""
    out: list[str] = []
    for chunk in _chunks(_translated(args)):
        setting = BY_FLAG.get(_flag_name(chunk[0]) or "")
        if setting is not None and stage in setting.stages:
            out += chunk
    return out
