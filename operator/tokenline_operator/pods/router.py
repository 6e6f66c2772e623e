"""``spec.router.kvEvents``: what the pods publish for cache-aware routers, read from a spec.

Pure functions shared by the ConfigMap (:mod:`config`), the pods (:mod:`deployment`), the
NetworkPolicy (:mod:`tokenline_operator.routing.network`) and the picker
(:mod:`tokenline_operator.routing.inference_pool`), so that the scheduler's
block size, hash scheme and seed and the picker's are the same by construction.

The hash scheme: ``engine.prefixCachingHashAlgo`` when set; else ``sha256_cbor`` (vLLM's) with
events on, because llm-d's indexer hashes every prompt itself with vLLM's scheme and finds
nothing under any other name, and ``blake2b`` (tokenline's, the scheduler's default) with events
off. With sha256_cbor the scheduler's ``PYTHONHASHSEED`` is ``router.kvEvents.hashSeed`` and
the picker's ``hashSeed`` repeats it. A Dynamo-style router, which rebuilds block hashes from
the token ids every ``BlockStored`` event carries, works with either scheme.
"""

from __future__ import annotations

from typing import Any

from tokenline.fetch.uri import HfURI
from tokenline.settings import BY_FLAG

from .. import names
from ..crd.spec import Spec, served_model_name
from . import model

#: The scheduler's block size: the pods' (no CRD field sets it), so the picker's too.
BLOCK_SIZE: int = BY_FLAG["block-size"].default
SHA256_CBOR = "sha256_cbor"


def _kv_events(spec: Spec) -> dict[str, Any]:
    return spec.get("router", {}).get("kvEvents", {})


def kv_events_enabled(spec: Spec) -> bool:
    return bool(_kv_events(spec).get("enabled"))


def hash_algo(spec: Spec) -> str | None:
    """The scheduler's --prefix-caching-hash-algo, or None to leave its default (blake2b)."""
    chosen = spec["engine"].get("prefixCachingHashAlgo")
    if chosen:
        return chosen
    return SHA256_CBOR if kv_events_enabled(spec) else None


def hash_seed(spec: Spec) -> str | None:
    """The scheduler's PYTHONHASHSEED: set exactly when its blocks are named by sha256_cbor."""
    if hash_algo(spec) != SHA256_CBOR:
        return None
    return str(_kv_events(spec).get("hashSeed", "42"))


def precise_routing(spec: Spec) -> bool:
    """Whether a picker can route on the events: they are on and named as llm-d names prompts.

    With blake2b the picker keeps the approximate prefix scorer (and the upstream image)."""
    return kv_events_enabled(spec) and hash_algo(spec) == SHA256_CBOR


def kv_events_endpoint() -> str:
    return f"tcp://*:{names.KV_EVENTS_PORT}"


def kv_replay_endpoint() -> str:
    return f"tcp://*:{names.KV_REPLAY_PORT}"


def tokenizer_model(spec: Spec) -> str:
    """The Hub id whose tokenizer the picker loads: ``router.kvEvents.tokenizer``, else the
    model's Hub id (``model.name`` unless tiny or a path, or an hf:// uri's), else the served
    name."""
    explicit = _kv_events(spec).get("tokenizer")
    if explicit:
        return explicit
    uri = model.parsed_uri(spec)
    if uri is not None:
        return uri.repo_id if isinstance(uri, HfURI) else served_model_name(spec)
    name = spec["model"].get("name", "")
    if name and name != "tiny" and not name.startswith(("/", ".")):
        return name
    return served_model_name(spec)
