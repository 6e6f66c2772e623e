"""Whether a child the operator wrote still holds what it wants there: the subset check that
repairs drift, and the stamp of the body last applied, which sees the fields a spec dropped."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .. import names


def is_subset(desired: Any, live: Any) -> bool:
    """Whether ``live`` already holds everything ``desired`` sets (API defaults may add more).

    Numbers and strings compare by text, because the API server returns quantities as
    strings (``nvidia.com/gpu: 1`` comes back as ``"1"``).
    """
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            key in live and is_subset(value, live[key]) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(is_subset(d, item) for d, item in zip(desired, live, strict=True))
        )
    if isinstance(desired, bool) or isinstance(live, bool):
        return desired == live
    if isinstance(desired, int | float | str) and isinstance(live, int | float | str):
        return str(desired) == str(live)
    return desired == live


def applied_hash(desired: dict[str, Any]) -> str:
    """A hash of the body the operator would apply (without its own stamp)."""
    text = json.dumps(desired, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def stamped(desired: dict[str, Any]) -> dict[str, Any]:
    """``desired`` with the hash of its body in an annotation.

    A subset check only sees the fields still desired: a field the spec dropped (a
    nodeSelector, a limit) stays on the live object and looks fine. The stamp changes with
    any change of the body, and server-side apply then drops the fields no longer set.
    """
    metadata = desired["metadata"]
    annotations = {**(metadata.get("annotations") or {})}
    annotations[names.ANNOTATION_APPLIED_HASH] = applied_hash(desired)
    return {**desired, "metadata": {**metadata, "annotations": annotations}}
