"""Every setting of the stage commands, declared once in `SETTINGS`.

A declaration names the flag, its parser, default and help, the stages that take it, and the
field of the operator's CRD that sets it (`declaration`). Everything else is derived from it:
the `Settings` dataclass the stages read (its fields, types and defaults), every stage's flags
and their TOKENLINE_* mirrors (`cli.py`), each child's command line under `tokenline serve`
(`serve.py`), the CRD's schema of each setting's field and the pod's ConfigMap (the operator's
`schema.py` and `config.py`) and so the chart's CRD and values schema. Tests under
tests/test_settings_declared_once.py and tests/operator fail when a surface drifts from it.

The declarations are grouped by what they configure, one module each, and `SETTINGS` keeps
their order: it is the order of every parser's flags, of the `Settings` fields, of the CRD's
fields in each section and of each container's environment (a changed order rolls pods).
"""

from __future__ import annotations

from tokenline.settings.api import API_SERVER, MAX_ALLOWED_ORIGINS, ORIGIN_PATTERN
from tokenline.settings.chat_template import CHAT_RENDERING
from tokenline.settings.declaration import (
    ALL_STAGES,
    API,
    BEHIND_API,
    SCHEDULER,
    CrdField,
    Setting,
    parse_bool,
    parse_bytes,
    settings_dataclass,
    stage_settings,
)
from tokenline.settings.every_stage import EVERY_STAGE
from tokenline.settings.kv_events import KV_EVENTS
from tokenline.settings.lora import LORA
from tokenline.settings.metrics_port import DEFAULT_METRICS_PORTS, METRICS_PORT
from tokenline.settings.pooling import POOLING
from tokenline.settings.ring import RING
from tokenline.settings.scheduler import ENGINE, TENSOR_PARALLEL

__all__ = [
    "ALL_STAGES",
    "API",
    "BEHIND_API",
    "BY_FLAG",
    "DEFAULT_METRICS_PORTS",
    "MAX_ALLOWED_ORIGINS",
    "ORIGIN_PATTERN",
    "SCHEDULER",
    "SETTINGS",
    "CrdField",
    "Setting",
    "Settings",
    "parse_bool",
    "parse_bytes",
    "settings_of",
]

SETTINGS: tuple[Setting, ...] = (
    *EVERY_STAGE,
    *RING,
    *API_SERVER,
    *METRICS_PORT,
    *ENGINE,
    *TENSOR_PARALLEL,
    *KV_EVENTS,
    *LORA,
    *CHAT_RENDERING,
    *POOLING,
)

BY_FLAG: dict[str, Setting] = {s.flag: s for s in SETTINGS}


def settings_of(stage: str) -> tuple[Setting, ...]:
    """The settings a stage's parser takes, in declaration order; ``serve`` for `serve`'s."""
    return stage_settings(SETTINGS, stage)


#: What every stage reads: one field per declaration (the four endpoints in one
#: `RingEndpoints`), with its type and default, in the order of `SETTINGS`.
Settings = settings_dataclass(SETTINGS, __name__)
