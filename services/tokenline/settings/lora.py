"""LoRA adapters served beside the base model: which ones, how many at once, and whether they
may be loaded and unloaded at runtime (vLLM's flags, under vLLM's names).
"""

from __future__ import annotations

from tokenline.settings.declaration import API, SCHEDULER, Setting, parse_bool

LORA: tuple[Setting, ...] = (
    Setting(
        "enable-lora",
        parse_bool,
        False,
        help="serve LoRA adapters on the base model: requests name one in `model`",
        stages=API | SCHEDULER,
        switch=True,
    ),
    Setting(
        "lora-modules",
        help="adapters to serve from the start, as vLLM takes them: NAME=URI (a PEFT directory "
        'or any URI --model takes) or {"name": ..., "path": ...}, several after one flag or '
        "the flag repeated",
        stages=SCHEDULER,
        repeatable=True,
        several=True,
        metavar="NAME=URI",
    ),
    Setting(
        "max-loras",
        int,
        4,
        help="adapters resident on the device at once; requests for others wait for a slot",
        stages=SCHEDULER,
    ),
    Setting(
        "max-lora-rank",
        int,
        16,
        help="highest adapter rank accepted (sizes the device slots)",
        stages=SCHEDULER,
    ),
    Setting(
        "max-cpu-loras",
        int,
        32,
        help="adapters kept in host memory, least recently used evicted first (at least "
        "--max-loras)",
        stages=SCHEDULER,
    ),
    Setting(
        "lora-config",
        help='a JSON file {"adapters": [{"name": ..., "uri": ...}]} re-read when it '
        "changes: adapters added are loaded, removed ones unloaded (the operator's ConfigMap)",
        stages=SCHEDULER,
    ),
    Setting(
        "allow-runtime-lora-updates",
        parse_bool,
        False,
        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also on with "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, as in vLLM)",
        stages=API,
        switch=True,
    ),
)
