"""How a setting is declared, and what is built from the declarations.

A declaration (`Setting`) names the flag, its parser, default and help, the stages that take
it, and the field of the operator's CRD (`CrdField`) that sets it. The declarations themselves
live in the modules beside this one, grouped by what they configure, and `tokenline.settings`
puts them together in `SETTINGS`; from them `settings_dataclass` builds the `Settings` class
the stages read (its fields, types and defaults) and `stage_settings` picks each stage's.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, make_dataclass
from typing import Any

from tokenline.protocol import STAGES
from tokenline.ring_security import RingSecurity
from tokenline.transport import RingEndpoints

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


def parse_sizes(value: str) -> str:
    """``512`` or ``1,2,4,8`` (or space-separated): positive integers, kept as ``1,2,4,8``."""
    parts = value.replace(",", " ").split()
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{value!r}: expected positive integers, e.g. 1,2,4,8")
    return ",".join(str(int(p)) for p in parts)


class CheckedText(str):
    """A flag's text with a form of its own (a JSON config, a list of weights): checked by the
    subclass's ``check`` when it is read, so a bad one fails at start naming the problem (a
    ValueError becomes argparse's error), and kept as its text."""

    @staticmethod
    def check(value: str) -> object:
        raise NotImplementedError

    def __new__(cls, value: str) -> CheckedText:
        try:
            cls.check(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return super().__new__(cls, value)


def sizes_of(value: str | None) -> list[int] | None:
    """`parse_sizes`' string as the integers it names; None stays None."""
    return [int(p) for p in value.split(",")] if value else None


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
    #: a repeatable flag that also takes several values at once (``--lora-modules a=X b=Y``)
    several: bool = False
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

    def value(self, settings: Any) -> Any:
        """Its value in a `Settings`."""
        value: Any = settings
        for part in (self.attr or self.flag.replace("-", "_")).split("."):
            value = getattr(value, part)
        return value


_TYPES: dict[Callable[[str], Any], type] = {parse_bool: bool, parse_bytes: int, parse_sizes: str}


def stage_settings(declared: Sequence[Setting], stage: str) -> tuple[Setting, ...]:
    """The declarations a stage's parser takes, in order; ``serve`` for `serve`'s."""
    if stage == "serve":
        return tuple(s for s in declared if s.serve)
    return tuple(s for s in declared if stage in s.stages)


def _field(setting: Setting) -> tuple[str, Any, Any]:
    if setting.repeatable:
        default = field(default_factory=list, repr=not setting.secret)  # never in a log line
    else:
        default = field(default=setting.default, repr=not setting.secret)
    return setting.field_name, setting.annotation, default


def _ring_security(self: Any) -> RingSecurity:
    return RingSecurity(self.ring_curve_keys, self.allow_insecure_ring)


def _model_names(self: Any) -> list[str]:
    """Every name requests may give the model, the primary first (vLLM's
    ``--served-model-name a b c``); /v1/models lists each."""
    return list(dict.fromkeys(self.served_model_name)) or [self.model]


def _model_name(self: Any) -> str:
    """The primary name: what metrics, kv events and LoRA checks carry."""
    return _model_names(self)[0]


def _settings_fields(declared: Sequence[Setting]) -> list[tuple[str, Any, Any]]:
    fields = []
    for setting in declared:
        if setting.field_name != "endpoints":
            fields.append(_field(setting))
        elif not any(name == "endpoints" for name, _, _ in fields):
            fields.append(("endpoints", RingEndpoints, field(default_factory=RingEndpoints)))
    return fields


def settings_dataclass(declared: Sequence[Setting], module: str) -> type:
    """What every stage reads: one field per declaration (the four endpoints in one
    `RingEndpoints`), with its type and default, in the order of ``declared``."""
    return make_dataclass(
        "Settings",
        _settings_fields(declared),
        namespace={
            "__module__": module,
            "__doc__": "The settings of one process, one field per declaration in `SETTINGS`.",
            "ring_security": property(_ring_security),
            "model_name": property(_model_name),
            "model_names": property(_model_names),
        },
    )
