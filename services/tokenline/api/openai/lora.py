"""Request bodies of /v1/load_lora_adapter and /v1/unload_lora_adapter, in vLLM's shapes
(``LoadLoRAAdapterRequest``, ``UnloadLoRAAdapterRequest``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from tokenline.api.openai.sampling import Text

# Unknown fields are refused by name (400 unsupported_parameter), as in every other body: a
# client relying on one (vLLM's load_inplace, say) learns it is not served here.
_CONFIG = ConfigDict(extra="forbid")


class LoadLoraAdapterRequest(BaseModel):
    model_config = _CONFIG

    lora_name: Text
    lora_path: Text  # a PEFT directory, or any URI --model takes


class UnloadLoraAdapterRequest(BaseModel):
    model_config = _CONFIG

    lora_name: Text
    # vLLM's number for a loaded adapter; accepted for its clients, but adapters are named
    # here, never numbered, so it selects nothing
    lora_int_id: int | None = None
