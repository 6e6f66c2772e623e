"""API keys: ``Authorization: Bearer <key>`` on every route but the probes and the metrics.

Keys come from ``--api-key`` (or ``TOKENLINE_API_KEY``) and from ``--api-key-file``. The file is
re-read when it changes, checked at most once a second by its identity (device, inode, size,
mtime) through any symlinks: a Kubernetes Secret volume rotates by swapping a symlink, so the
new key works and the old one stops working without a restart. A file that cannot be read at
startup stops the api; one that vanishes later keeps its last keys (a half-finished rotation
must not open the door).

A key file line may name its key: ``team-a sk-...`` (the name, whitespace, the key). The name
is the request's tenant (priority and fair share, scheduler/waiting.py); a bearer token never
holds whitespace, so the two forms cannot be confused.

Presented keys are compared as SHA-256 digests with ``hmac.compare_digest`` against every
configured key, so neither the key's content nor which key matched shows in the timing. No key
is ever logged: only the file's path and how many keys it holds.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import time
from collections.abc import Callable, Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger(__name__)

# Liveness, readiness and scraping stay open: kubelet and Prometheus carry no key.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
RECHECK_INTERVAL_S = 1.0


def _digest(key: str | bytes) -> bytes:
    raw = key.encode() if isinstance(key, str) else key
    return hashlib.sha256(raw).digest()


def parse_key_file(text: str) -> list[str]:
    """One key per line; blank lines and ``#`` comments are ignored."""
    return [key for _, key in named_keys(text)]


def named_keys(text: str) -> list[tuple[str, str]]:
    """(name, key) per line: ``NAME KEY``, or ``KEY`` alone (name "")."""
    keys = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, key = line.rpartition(" ")
            keys.append((name.strip(), key))
    return keys


class KeyFileError(RuntimeError):
    pass


class ApiKeys:
    """The keys in force now: the fixed ones plus the key file's current contents."""

    def __init__(
        self,
        keys: Iterable[str] = (),
        key_file: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        recheck_s: float = RECHECK_INTERVAL_S,
    ) -> None:
        self._fixed = [("", _digest(k)) for k in keys if k]
        self._file = key_file
        self._clock = clock
        self._recheck_s = recheck_s
        self._file_keys: list[tuple[str, bytes]] = []
        self._identity: tuple | None = None
        self._checked_at = float("-inf")
        if key_file is not None:
            try:
                self._reload(os.stat(key_file))
            except OSError as exc:
                raise KeyFileError(
                    f"cannot read the API key file {key_file}: {exc.strerror}; fix the path "
                    "or its permissions (--api-key-file)"
                ) from exc
            self._checked_at = clock()

    @property
    def enabled(self) -> bool:
        """Keys are required once any are configured, even if the key file is empty now: an
        empty file locks every client out rather than letting everyone in."""
        return bool(self._fixed) or self._file is not None

    def _reload(self, stat: os.stat_result) -> None:
        with open(self._file, encoding="utf-8", errors="replace") as f:
            keys = named_keys(f.read())
        self._file_keys = [(name, _digest(k)) for name, k in keys]
        self._identity = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        log.info("api: %d API key(s) in force from %s", len(keys), self._file)
        if not keys and not self._fixed:
            log.warning("api: %s holds no API key; every request is refused", self._file)

    def _refresh(self) -> None:
        now = self._clock()
        if self._file is None or now - self._checked_at < self._recheck_s:
            return
        self._checked_at = now
        try:
            stat = os.stat(self._file)  # follows the Secret volume's ..data symlink
            identity = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
            if identity != self._identity:
                self._reload(stat)
        except OSError as exc:
            log.warning(
                "api: cannot read the API key file %s (%s); keeping its last %d key(s)",
                self._file,
                exc.strerror,
                len(self._file_keys),
            )

    def accepts(self, key: str | bytes) -> bool:
        return self.match(key) is not None

    def match(self, key: str | bytes) -> str | None:
        """The name of the key presented ("" for an unnamed one), or None: no such key."""
        self._refresh()
        presented = _digest(key)
        found = None
        for name, known in (*self._fixed, *self._file_keys):  # no early exit: all compared
            if hmac.compare_digest(presented, known) and found is None:
                found = name
        return found


def bearer_token(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


def _unauthorized(message: str) -> tuple[dict, bytes]:
    error = {"message": message, "type": "invalid_request_error", "param": None}
    body = json.dumps({"error": {**error, "code": "invalid_api_key"}}).encode()
    start = {
        "status": 401,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ],
    }
    return start, body


class ApiKeyAuth:
    """Pure ASGI middleware: outermost, so an unauthenticated request is refused before its
    body is read or anything else runs."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys.enabled or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        name = self.keys.match(token) if token is not None else None
        if name is not None:
            if name:  # the request's tenant (Request.state.tenant)
                scope.setdefault("state", {})["tenant"] = name
            await self.app(scope, receive, send)
            return
        if token is None:
            message = (
                "You didn't provide an API key. Send it in the Authorization header: "
                "`Authorization: Bearer YOUR_KEY`."
            )
        else:
            message = "Incorrect API key provided. Check the key you send as `Bearer` token."
        start, body = _unauthorized(message)
        await send({"type": "http.response.start", **start})
        await send({"type": "http.response.body", "body": body})
