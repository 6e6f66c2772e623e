"""The ring: the ZMQ endpoint each stage binds, and how its sockets are secured."""

from __future__ import annotations

from tokenline.protocol import STAGES
from tokenline.settings.declaration import Setting, parse_bool
from tokenline.transport import DEFAULT_ENDPOINTS

RING: tuple[Setting, ...] = (
    *(
        Setting(
            f"{stage}-endpoint",
            default=DEFAULT_ENDPOINTS[stage],
            help=f"ZMQ endpoint the {stage} stage binds (tcp:// or ipc://)",
            attr=f"endpoints.{stage}",
        )
        for stage in STAGES
    ),
    Setting(
        "ring-curve-keys",
        help="directory of the ring's CurveZMQ certificate and the public keys allowed to "
        "connect (`tokenline ring-keys --out DIR`): every ring socket is encrypted and "
        "authenticated; needed for an endpoint beyond loopback or IPC",
    ),
    Setting(
        "allow-insecure-ring",
        parse_bool,
        False,
        help="start even though a ring endpoint beyond loopback or IPC is neither encrypted "
        "nor authenticated (logged at every start)",
        switch=True,
    ),
)
