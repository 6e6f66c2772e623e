"""The one exception a fetch raises, with a reason an operator can put in a condition."""

from __future__ import annotations


class FetchError(Exception):
    """A model could not be delivered. ``str()`` says what went wrong and what to do.

    ``reason`` is a short CamelCase word (InvalidURI, NotFound, Unauthorized, IntegrityError,
    DiskFull, PermissionDenied, NetworkError, LockTimeout, NotSupported) that the operator copies
    into ``status.model.reason`` and the ``ModelReady`` condition. Messages never carry secrets:
    URIs in them are redacted and credentials are only ever named, never shown.
    """

    def __init__(self, message: str, reason: str = "FetchFailed") -> None:
        super().__init__(message)
        self.reason = reason


class InvalidURI(FetchError, ValueError):
    """A model URI that cannot be fetched as written (raised before any I/O)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="InvalidURI")


class Transient(Exception):
    """A failure worth retrying (a cut connection, a 5xx, a timeout). Internal to the fetcher:
    it becomes a FetchError with reason NetworkError once the retries are spent."""
