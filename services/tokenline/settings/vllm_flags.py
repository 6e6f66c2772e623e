"""`vllm serve` flags that deployments carry, read as vLLM means them.

A flag tokenline has under another name becomes that flag; one that asks for what tokenline
always does is accepted and said so at start; one tokenline has no such thing for is refused
with what to use instead. None is silently ignored. The flags tokenline shares with vLLM under
the same name (``--max-model-len``, ``--tensor-parallel-size``, ``--lora-modules``,
``--chat-template``, ``--chat-template-content-format``, ...) are its own and need no entry
here. The README's table is this one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VllmFlag:
    #: tokenline's flags standing for it, or () when it asks for what tokenline always does
    becomes: tuple[str, ...] = ()
    takes_value: bool = False
    #: why it changes nothing here (said at start), or why it is refused (with refused)
    note: str = ""
    refused: bool = False


VLLM_FLAGS: dict[str, VllmFlag] = {
    "--enable-prefix-caching": VllmFlag(note="prefix caching is on by default"),
    "--no-enable-prefix-caching": VllmFlag(("--no-prefix-caching",)),
    "--enable-auto-tool-choice": VllmFlag(
        note="tool_choice auto is always served (the format from --tool-call-parser)"
    ),
    "--disable-log-requests": VllmFlag(note="requests are not logged unless --log-level debug"),
    "--enable-log-requests": VllmFlag(("--log-level", "debug")),
    "--trust-remote-code": VllmFlag(
        note="no model's own code is ever run (models are served by tokenline's modules or "
        "transformers'); a model that needs its own code cannot be served"
    ),
    "--tokenizer": VllmFlag(
        takes_value=True,
        refused=True,
        note="the tokenizer is always the model's own; put the tokenizer files in the model "
        "directory (or pin only the template with --chat-template)",
    ),
    "--tokenizer-revision": VllmFlag(
        takes_value=True, refused=True, note="the tokenizer follows --revision, as the weights do"
    ),
    "--response-role": VllmFlag(
        takes_value=True, refused=True, note="replies always have the role assistant"
    ),
    "--uvicorn-log-level": VllmFlag(
        takes_value=True, refused=True, note="use --log-level, which sets every logger"
    ),
    "--root-path": VllmFlag(
        takes_value=True,
        refused=True,
        note="serve the api at / and let the proxy strip its prefix",
    ),
}


def translate(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` with vLLM's flags replaced by tokenline's, and the lines to say at start.
    Raises SystemExit for a refused flag, saying what to use instead."""
    out: list[str] = []
    said: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        name, has_inline, _ = arg.partition("=")
        flag = VLLM_FLAGS.get(name)
        if flag is None:
            out.append(arg)
            continue
        if flag.refused:
            raise SystemExit(f"{name} is vLLM's and not served by tokenline: {flag.note}")
        if flag.takes_value and not has_inline:
            skip = i + 1 < len(argv)
        out.extend(flag.becomes)
        if flag.note:
            said.append(f"{name}: accepted; {flag.note}")
    return out, said
