"""KV-cache events: the scheduler publishes them in vLLM's format (vLLM's --kv-events-config,
publisher zmq), for a router that routes on cached prefixes.
"""

from __future__ import annotations

from tokenline.settings.declaration import SCHEDULER, Setting

KV_EVENTS: tuple[Setting, ...] = (
    Setting(
        "kv-events-endpoint",
        help="publish KV-cache events in vLLM's format on this ZMQ endpoint: bound when its "
        "host is * (tcp://*:5557), else connected to (a central subscriber). Off by default",
        stages=SCHEDULER,
    ),
    Setting(
        "kv-events-replay-endpoint",
        help="ZMQ ROUTER endpoint that answers a subscriber's 'events since sequence N' "
        "(tcp://*:5558); off by default",
        stages=SCHEDULER,
    ),
    Setting(
        "kv-events-topic",
        help="topic of every event message (default kv@<POD_IP or host name>@<served model "
        "name>, as llm-d expects)",
        stages=SCHEDULER,
    ),
    Setting(
        "kv-events-hwm",
        int,
        100_000,
        help="high-water mark of a subscriber's queue, in batches: past it batches are "
        "dropped (counted, a sequence gap the subscriber can replay)",
        stages=SCHEDULER,
    ),
    Setting(
        "kv-events-buffer-steps",
        int,
        10_000,
        help="event batches kept for replay",
        stages=SCHEDULER,
    ),
)
