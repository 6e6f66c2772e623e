"""Who may speak on the ring: local endpoints, or peers authenticated with CurveZMQ.

The stages of one pod talk over IPC in a shared volume or over loopback, which nothing outside
the pod can reach. An endpoint anywhere else (a pod IP, ``0.0.0.0``, a host name) would carry
prompts and replies in plaintext and accept frames from anyone who can connect, so a stage
refuses to start with one unless the ring is encrypted and authenticated with CurveZMQ
(``--ring-curve-keys DIR``) or the operator of the stage said ``--allow-insecure-ring``.

With keys, every ring socket speaks CURVE. ``DIR`` holds the ring's certificate
(``ring.key_secret``, made by ``tokenline ring-keys --out DIR``) and the public keys
(``*.key``) allowed to connect; a ZAP authenticator (pyzmq's ``zmq.auth``) refuses any other
peer before a frame of it is read.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)
CERTIFICATE = "ring.key_secret"


class InsecureRing(RuntimeError):
    """A ring endpoint beyond this machine without CurveZMQ, and no explicit opt-out."""


def is_local(endpoint: str) -> bool:
    """True for endpoints nothing outside this machine (or pod) can reach."""
    transport, _, address = endpoint.partition("://")
    if transport in ("ipc", "inproc"):
        return True
    if transport != "tcp":
        return False
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name or an interface name: it may well face the network
        return False


def create_keys(directory: str) -> str:
    """Write a new ring certificate into ``directory``; returns the secret file's path."""
    os.makedirs(directory, exist_ok=True)
    _, secret = zmq.auth.create_certificates(directory, "ring")
    os.chmod(secret, 0o600)
    return secret


def keys_problem(directory: str) -> str:
    """Why ``directory`` cannot authenticate CurveZMQ peers as ``create_keys`` made it; "" when
    it can. Every holder of the directory must find its own public key allowed there, or the
    pods that share it refuse each other."""
    if not os.path.isdir(directory):
        return f"{directory} is not a directory"
    path = os.path.join(directory, CERTIFICATE)
    try:
        public, secret = zmq.auth.load_certificate(path)
        allowed = zmq.auth.load_certificates(directory)
    except (OSError, ValueError) as exc:
        return f"cannot read the certificate {path} ({exc})"
    if secret is None:
        return f"{path} holds no secret key"
    if public not in allowed:
        return f"{directory} does not hold {CERTIFICATE}'s public key (a *.key file)"
    return ""


@dataclass(frozen=True)
class RingSecurity:
    curve_keys: str | None = None  # the directory of --ring-curve-keys
    allow_insecure: bool = False

    def check(self, stage: str, endpoints: list[str]) -> None:
        """Refuse endpoints beyond this machine that nothing protects; say why and what to do."""
        exposed = [e for e in endpoints if not is_local(e)]
        if not exposed or self.curve_keys:
            return
        if self.allow_insecure:
            log.warning(
                "%s: the ring endpoint(s) %s are not local and travel in plaintext, "
                "unauthenticated (--allow-insecure-ring)",
                stage,
                ", ".join(exposed),
            )
            return
        raise InsecureRing(
            f"{stage}: the ring endpoint(s) {', '.join(exposed)} can be reached from beyond "
            "this machine; use IPC or loopback endpoints, or encrypt and authenticate the ring "
            "with --ring-curve-keys DIR (see `tokenline ring-keys`), or accept the risk with "
            "--allow-insecure-ring"
        )

    @property
    def curve(self) -> bool:
        return self.curve_keys is not None

    def _keypair(self) -> tuple[bytes, bytes]:
        path = os.path.join(self.curve_keys or "", CERTIFICATE)
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise InsecureRing(
                f"cannot read the ring certificate {path} ({exc}); create one with "
                "`tokenline ring-keys --out DIR`"
            ) from exc
        if secret is None:
            raise InsecureRing(f"{path} holds no secret key; it must be a *.key_secret file")
        return public, secret

    def start_authenticator(self, context: zmq.Context) -> ThreadAuthenticator | None:
        """Refuse every peer whose public key is not in the keys directory (ZAP)."""
        if not self.curve:
            return None
        # A plain context over the same libzmq one, so an asyncio context's sockets are
        # authenticated by the same thread.
        authenticator = ThreadAuthenticator(zmq.Context.shadow(context.underlying))
        authenticator.start()
        authenticator.configure_curve(domain="*", location=self.curve_keys)
        return authenticator

    def serve(self, sock: zmq.Socket) -> None:
        """Make a socket that binds a CURVE server (before it binds)."""
        if self.curve:
            sock.curve_publickey, sock.curve_secretkey = self._keypair()
            sock.curve_server = True

    def connect(self, sock: zmq.Socket) -> None:
        """Make a socket that connects a CURVE client of the ring's server key."""
        if self.curve:
            public, secret = self._keypair()
            sock.curve_publickey, sock.curve_secretkey = public, secret
            sock.curve_serverkey = public
