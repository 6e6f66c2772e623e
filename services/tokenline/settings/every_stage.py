"""What every stage takes: the model it serves, its context limit, the log level and how long
draining lasts.
"""

from __future__ import annotations

from tokenline.settings.declaration import CrdField, Setting

EVERY_STAGE: tuple[Setting, ...] = (
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
        help="the names clients use, as vLLM takes them: several after one flag are aliases "
        "of the first, which answers, metrics and events carry (default: the --model value)",
        # the CRD sets one name (the one its status reports); aliases are a command line's
        crd=CrdField(
            "model.servedName",
            "The name /v1/models lists and requests use; defaults to `name`.",
            {"type": "string", "minLength": 1},
        ),
        repeatable=True,
        several=True,
        metavar="NAME",
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
)
