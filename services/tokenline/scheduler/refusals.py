"""Requests the engine can never serve: each fails at once with an OpenAI error."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine can never serve; it fails at once with an OpenAI error naming
    ``param``, the request field at fault."""

    code = "invalid_request_error"
    param: str | None = None
    http_status = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        if param is not None:
            self.param = param


class UnknownModel(InvalidRequest):
    """A request names a LoRA adapter this scheduler does not serve (OpenAI's 404)."""

    code = "model_not_found"
    param = "model"
    http_status = 404


class KVCacheTooSmall(InvalidRequest):
    """The prompt can never fit in the KV pool, however long it waits."""

    code = "kv_cache_too_small"
    param = "messages"
