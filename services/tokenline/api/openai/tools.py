"""The request fields of structured outputs and tools: ``response_format``, ``tools``,
``tool_choice``. What they mean together, and the grammar they make, is
api/function_calling/grammars.py."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)
# OpenAI's own limit on a request's tools. Each is checked, and all are compiled into one
# grammar, before the request is admitted: without a bound, one body of thousands of tools
# would hold the api for seconds.
MAX_TOOLS = 128


class JsonSchemaFormat(BaseModel):
    model_config = _CONFIG

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # "schema" shadows a BaseModel attribute, hence the alias
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _CONFIG

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(BaseModel):
    model_config = _CONFIG

    name: str | None = None  # checked in `grammars.check_tools`, so the 400 names the tool
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _CONFIG

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _CONFIG

    name: str


class NamedToolChoice(BaseModel):
    model_config = _CONFIG

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
