"""The LoRA adapters this pod serves, as the api knows them: what a request's ``model`` may name.

The scheduler holds the adapters; the api learns their names from the scheduler's status in
every returning heartbeat (``lora_adapters``) and from its answer to each load or unload
(`protocol.LoraAnswer`). Both travel the ring in order behind the calls that changed the set,
so the last one to arrive is the newest: an adapter is usable the moment its load is answered,
and gone the moment its unload is, without waiting for the next heartbeat.

Where an adapter came from (``root`` on /v1/models) is known only for those loaded through this
api replica; an adapter the scheduler was started with (``--lora-modules``, a scheduler flag)
shows its name there instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from urllib.parse import urlsplit, urlunsplit

from tokenline import protocol

# Adapter names are listed in metric labels joined by commas (vllm:lora_requests_info), so a
# comma in one would split it in two there; the length bounds what each heartbeat carries.
MAX_NAME_CHARS = 256


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name an adapter (None: it can)."""
    if not name:
        return "the adapter name is empty"
    if len(name) > MAX_NAME_CHARS:
        return f"the adapter name is {len(name)} characters; at most {MAX_NAME_CHARS} are allowed"
    if "," in name or any(not ch.isprintable() or ch.isspace() for ch in name):
        return "the adapter name may hold no commas, spaces or control characters"
    return None


def shown_uri(uri: str) -> str:
    """``uri`` as /v1/models and the logs may show it: without a password in it or a query
    (a presigned URL's signature lives there), which would hand out access to whoever reads."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return uri
    if not parts.scheme or not parts.netloc:
        return uri  # a path
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


class ChangeInProgress(Exception):
    """A load or unload of the same adapter is already on its way around the ring."""


class LoraNames:
    """Adapter names the scheduler serves now, and the paths of those loaded through here."""

    def __init__(
        self, enabled: bool, base: str, base_root: str, aliases: Iterable[str] = ()
    ) -> None:
        self.enabled = enabled  # --enable-lora: requests may name adapters at all
        self.base = base  # the served model name (the primary one)
        # every name of the base model, the primary first (--served-model-name a b c)
        self.bases = list(dict.fromkeys([base, *aliases]))
        self.base_root = base_root  # what the base was loaded from (--model)
        self._names: list[str] = []
        self._roots: dict[str, str] = {}  # name → the path or URI it was loaded from
        self._changing: set[str] = set()  # names with a load or unload on its way

    # ── inputs (the ring client's listener) ───────────────────────────────────────────────────────
    def on_status(self, scheduler: protocol.StageStatus | None) -> None:
        """The scheduler's status from a returning heartbeat: its adapters at that moment."""
        if scheduler is not None:
            self._set(scheduler.lora_adapters)

    def on_answer(self, answer: protocol.LoraAnswer) -> None:
        """The scheduler's answer to a load or unload: its adapters right after it."""
        self._set(answer.adapters)

    def loaded(self, name: str, uri: str) -> None:
        """``name`` was loaded from ``uri`` (its answer came): remember where it came from."""
        if name in self._names:
            self._roots[name] = shown_uri(uri)

    @contextlib.contextmanager
    def changing(self, name: str) -> Iterator[None]:
        """Hold ``name`` while its load or unload travels: a second change of the same adapter
        meanwhile raises `ChangeInProgress`, so two loads never race to the scheduler."""
        if name in self._changing:
            raise ChangeInProgress(name)
        self._changing.add(name)
        try:
            yield
        finally:
            self._changing.discard(name)

    def _set(self, names: Iterable[str]) -> None:
        self._names = [n for n in dict.fromkeys(names) if n and n not in self.bases]
        # Forget the paths of adapters gone, so the map holds no more than the scheduler does.
        served = set(self._names)
        self._roots = {n: r for n, r in self._roots.items() if n in served}

    # ── answers ────────────────────────────────────────────────────────────────────────────────
    @property
    def names(self) -> list[str]:
        return list(self._names) if self.enabled else []

    def __contains__(self, name: object) -> bool:
        return self.enabled and name in self._names

    def resolve(self, model: str | None) -> str | None:
        """The adapter that serves a request for ``model``: "" for the base model (also when
        ``model`` is not sent), the adapter's name for an adapter, None for anything else."""
        if model is None or model in self.bases:
            return ""
        return model if model in self else None

    def cards(self, created: int) -> list[dict]:
        """/v1/models' entries, as vLLM lists them: one for each name of the base model, then
        each adapter with the primary name as its ``parent`` and where it was loaded from as
        its ``root``."""
        bases = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "tokenline",
                "root": self.base_root,
                "parent": None,
            }
            for name in self.bases
        ]
        adapters = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "tokenline",
                "root": self._roots.get(name) or name,
                "parent": self.base,
            }
            for name in self.names
        ]
        return [*bases, *adapters]
