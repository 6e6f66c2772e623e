"""``--lora-config FILE``: the adapters a JSON file names, turned into loads and unloads.

The operator writes ``{"adapters": [{"name": ..., "uri": ...}]}`` into a ConfigMap mounted as a
volume; the kubelet swaps the file in place (an atomic rename of the ``..data`` link) when the
ConfigMap changes, without restarting the pod. The scheduler calls `LoraConfigWatcher.poll`
between steps; it stats the file and re-reads it only when its modification time, size or
inode changed, and answers what to do: `LoraChange` ``load`` for an adapter added (or whose uri
changed, after its ``unload``), ``unload`` for one no longer listed.

Pure: no engine, no torch; the caller decides how and when a change is applied (a request in
flight on an adapter being unloaded finishes first, the engine's business). A file that cannot
be read or parsed, or that names an adapter twice or an adapter without a name or uri, logs
an error and changes nothing: the adapters loaded from the last good file stay. A missing file
(the ConfigMap not yet mounted) is an empty list only once it had been seen and then vanished,
which a ConfigMap volume never does by itself; before the first good read nothing is loaded.
Only adapters loaded from the file are ever unloaded by it: ``--lora-modules`` and runtime
loads are not the file's to remove.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

#: Adapter names the file may use (the CRD's rule): they travel in `model` and in labels.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass(frozen=True)
class LoraChange:
    """One thing to do: load ``name`` from ``uri``, or unload ``name`` (``uri``: the one it
    was loaded from)."""

    action: Literal["load", "unload"]
    name: str
    uri: str


class LoraConfigError(ValueError):
    """The file is not a valid adapters list; the message says why."""


def parse_adapters(text: str) -> dict[str, str]:
    """The adapters of a config file's text, name → uri, in file order."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LoraConfigError(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("adapters", []), list):
        raise LoraConfigError('expected {"adapters": [{"name": ..., "uri": ...}, ...]}')
    adapters: dict[str, str] = {}
    for index, item in enumerate(doc.get("adapters", [])):
        if not isinstance(item, dict):
            raise LoraConfigError(f"adapters[{index}]: expected an object with name and uri")
        name, uri = item.get("name"), item.get("uri")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise LoraConfigError(f"adapters[{index}]: name {name!r} must match [A-Za-z0-9._-]+")
        if not isinstance(uri, str) or not uri.strip():
            raise LoraConfigError(f"adapters[{index}] ({name}): uri must be a non-empty string")
        if name in adapters:
            raise LoraConfigError(f"adapters[{index}]: {name!r} is listed twice")
        adapters[name] = uri.strip()
    return adapters


class LoraConfigWatcher:
    """Diffs the adapters of ``path`` against those loaded from it, each time it changes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        #: what the file asked for at its last good read (name → uri), all of it "loaded"
        #: once the caller applied the changes `poll` returned
        self._loaded: dict[str, str] = {}
        self._seen: tuple[int, int, int] | None = None
        self._had_file = False
        #: the last read's error, or None (for status and tests)
        self.error: str | None = None

    @property
    def adapters(self) -> dict[str, str]:
        """The adapters from the file, name → uri, as of the last good read."""
        return dict(self._loaded)

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)  # follows the kubelet's ..data link
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def poll(self) -> list[LoraChange]:
        """The loads and unloads since the last call: unloads first, then loads, each in
        name order for unloads and file order for loads. An unchanged file costs one stat."""
        try:
            stamp = self._stamp()
        except OSError as exc:
            return self._fail(f"cannot stat: {exc}")
        if stamp == self._seen:
            return []
        if stamp is None:
            self._seen = None
            if not self._had_file:
                return []
            log.warning("LoRA config %s is gone: unloading its adapters", self.path)
            return self._apply({})
        try:
            text = self.path.read_text(encoding="utf-8")
            wanted = parse_adapters(text)
        except (OSError, UnicodeDecodeError, LoraConfigError) as exc:
            self._seen = stamp  # not again until it changes
            return self._fail(str(exc))
        self._seen = stamp
        self._had_file = True
        return self._apply(wanted)

    def _fail(self, message: str) -> list[LoraChange]:
        self.error = message
        log.error("LoRA config %s ignored, adapters unchanged: %s", self.path, message)
        return []

    def _apply(self, wanted: dict[str, str]) -> list[LoraChange]:
        self.error = None
        old = self._loaded
        unloads = [
            LoraChange("unload", name, uri)
            for name, uri in sorted(old.items())
            if wanted.get(name) != uri
        ]
        loads = [
            LoraChange("load", name, uri) for name, uri in wanted.items() if old.get(name) != uri
        ]
        self._loaded = dict(wanted)
        if unloads or loads:
            log.info(
                "LoRA config %s: load %s, unload %s",
                self.path,
                [c.name for c in loads] or "-",
                [c.name for c in unloads] or "-",
            )
        return [*unloads, *loads]
