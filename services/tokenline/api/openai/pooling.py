"""Request bodies of the pooling endpoints (pydantic): OpenAI's ``/v1/embeddings``, the
Cohere/Jina ``/rerank`` that vLLM serves, and vLLM's ``/score`` and ``/classify``. Unknown
fields are refused (400 ``unsupported_parameter``), as in every other body."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenline.api.openai.sampling import INT32_MAX, Text, TokenId

MAX_INPUTS = 2048  # inputs (or documents) one request may send, as OpenAI allows
_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)

EmbeddingInput = Text | list[int]


class _Inputs(BaseModel):
    """What the embeddings and classify bodies share: the model and OpenAI's four input
    shapes."""

    model_config = _CONFIG

    model: Text | None = None
    # a string, strings, token ids, or lists of token ids (OpenAI's four shapes)
    input: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    user: Text | None = None  # OpenAI's end-user id: accepted, not used

    @field_validator("input")
    @classmethod
    def _some_input(cls, value):
        if isinstance(value, list):
            if not value:
                raise ValueError("the input list is empty; send at least one input")
            if len(value) > MAX_INPUTS:
                raise ValueError(f"{len(value)} inputs; send at most {MAX_INPUTS} per request")
            if any(isinstance(v, list) and not v for v in value):
                raise ValueError("an input of token ids is empty; send at least one id")
        return value

    def inputs(self) -> list[EmbeddingInput]:
        """Each input, as text or token ids."""
        if isinstance(self.input, str):
            return [self.input]
        if isinstance(self.input[0], int):
            return [list(self.input)]
        return list(self.input)


class EmbeddingRequest(_Inputs):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=INT32_MAX)


class ClassifyRequest(_Inputs):
    """vLLM's ``/classify``: the inputs in the embeddings' shapes."""


class Document(BaseModel):
    model_config = _CONFIG

    text: Text


class RerankRequest(BaseModel):
    model_config = _CONFIG

    model: Text | None = None
    query: Text
    documents: list[Text | Document] = Field(min_length=1, max_length=MAX_INPUTS)
    top_n: int | None = Field(default=None, ge=0)  # None or 0: every document
    return_documents: bool = True

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(BaseModel):
    model_config = _CONFIG

    model: Text | None = None
    # one against one, one against many, or many against as many (pairwise)
    text_1: Text | list[Text]
    text_2: Text | list[Text]

    def pairs(self) -> list[tuple[str, str]]:
        """The (text_1, text_2) pairs scored, in order; raises ValueError when the two lists
        cannot be paired."""
        first = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        second = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        if not first or not second:
            raise ValueError("text_1 and text_2 must each hold at least one text")
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise ValueError(
                f"text_1 holds {len(first)} texts and text_2 {len(second)}: send one text_1, "
                "or as many as text_2"
            )
        if len(first) > MAX_INPUTS:
            raise ValueError(f"{len(first)} pairs; send at most {MAX_INPUTS} per request")
        return list(zip(first, second, strict=True))
