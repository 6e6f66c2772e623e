"""Where the stages behind the api serve their Prometheus metrics (the api serves /metrics on
its own port).
"""

from __future__ import annotations

from tokenline.settings.declaration import BEHIND_API, Setting

DEFAULT_METRICS_PORTS = {"tokenizer": 8001, "scheduler": 8002, "detokenizer": 8003}

METRICS_PORT: tuple[Setting, ...] = (
    Setting(
        "metrics-port",
        int,
        0,  # the api's: no separate metrics server (it serves /metrics itself)
        help="Prometheus port",
        stages=BEHIND_API,
        serve=False,  # serve gives the stages port+1..3
        stage_defaults=DEFAULT_METRICS_PORTS,
    ),
)
