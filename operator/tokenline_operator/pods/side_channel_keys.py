"""The KV side channel's keys of a disaggregated service: one CurveZMQ certificate that its
prefill and decode pods share, so a decode pod reads KV only from pods holding it.

Without keys, a client that reaches a decode pod could name a side channel of its own in
``kv_transfer_params.remote_host`` and have its KV cached under a prompt's names for other
users' requests. The operator makes the certificate once per InferenceService (pyzmq's
``zmq.auth``, the format of ``tokenline ring-keys``), keeps it in a Secret the service owns
(never rewritten: a new certificate would part running pods), mounts it read-only into every
scheduler of both roles and names it in ``--kv-transfer-config``.
"""

from __future__ import annotations

import base64
import tempfile
from pathlib import Path
from typing import Any

from ..objects import Manifest, Owner, metadata

#: Where the scheduler containers find the keys (``side_channel_keys`` in the extra config).
KEYS_DIR = "/etc/tokenline/kv-side-channel"
VOLUME = "kv-side-channel-keys"
#: The certificate's files, as ``tokenline ring-keys`` names them.
FILES = ("ring.key", "ring.key_secret")
#: Owner and group may read: the files belong to root and to the pod's fsGroup, the stages'.
FILE_MODE = 0o440


def secret_name(owner: Owner) -> str:
    return f"{owner.name}-kv-side-channel"


def new_secret(owner: Owner) -> Manifest:
    """A Secret holding a new certificate (its public key is also the one admitted)."""
    import zmq.auth

    with tempfile.TemporaryDirectory() as directory:
        zmq.auth.create_certificates(directory, "ring")
        data = {
            name: base64.b64encode((Path(directory) / name).read_bytes()).decode() for name in FILES
        }
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(owner, secret_name(owner)),
        "type": "Opaque",
        "data": data,
    }


def mount(owner: Owner, pod_spec: dict[str, Any], scheduler: dict[str, Any]) -> None:
    """The Secret as files of ``KEYS_DIR`` in the scheduler container, read-only."""
    pod_spec["volumes"] = [
        *pod_spec.get("volumes", []),
        {
            "name": VOLUME,
            "secret": {"secretName": secret_name(owner), "defaultMode": FILE_MODE},
        },
    ]
    scheduler["volumeMounts"] = [
        *scheduler.get("volumeMounts", []),
        {"name": VOLUME, "mountPath": KEYS_DIR, "readOnly": True},
    ]
