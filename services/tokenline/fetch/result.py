"""What a fetch delivers: where the model is and what it is."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenline.fetch.manifest import FileEntry


@dataclass(frozen=True)
class FetchResult:
    """Where the model is and what it is; ``status()`` is the operator's ``status.model``."""

    uri: str  # redacted: safe to log and to put in a status
    scheme: str
    path: Path  # the directory to load the model from
    revision: str | None  # the Hub commit the files come from
    digest: str | None  # sha256 over the files (or the archive), "sha256:..."
    size: int
    files: tuple[FileEntry, ...]
    downloaded: int = 0  # bytes received in this call
    cached: bool = False  # the model was complete already: nothing was fetched
    in_place: bool = False  # read where it is (a directory, pvc://, a mounted oci:// image)

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {"uri": self.uri, "state": "Ready", "size": self.size}
        if self.revision:
            body["revision"] = self.revision
        if self.digest:
            body["digest"] = self.digest
        return body
