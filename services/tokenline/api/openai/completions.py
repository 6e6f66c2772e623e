"""The completion request (pydantic): prompts as text or token ids, echo, legacy logprobs."""

from __future__ import annotations

import msgspec
from pydantic import Field, ValidationInfo, field_validator

from tokenline.api.openai.generation_defaults import GenerationDefaults
from tokenline.api.openai.sampling import (
    INT32_MAX,
    MAX_TOP_LOGPROBS,
    SamplingFields,
    Text,
    TokenId,
)
from tokenline.api.openai.tools import ResponseFormat
from tokenline.protocol import SamplingParams

Prompt = str | list[int]  # text, or token ids


class CompletionRequest(SamplingFields):
    # One prompt or a list; each as text or as token ids. Choices go prompt by prompt, n each.
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    response_format: ResponseFormat | None = (
        None  # as vLLM accepts it; api/function_calling/grammars.py
    )
    # OpenAI's default; 0 generates nothing: with echo and logprobs, it scores the prompt;
    # null: the generation config's max_new_tokens, else to the end of the context (vLLM)
    max_tokens: int | None = Field(default=16, ge=0, le=INT32_MAX)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, strict=True)
    best_of: int | None = Field(default=None, ge=1)
    suffix: Text | None = Field(default=None, json_schema_extra={"maxLength": 0})

    def wanted_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, value: list) -> list:
        if isinstance(value, list):
            if not value:
                raise ValueError("the prompt list is empty; send a prompt")
            if any(isinstance(p, list) and not p for p in value):
                raise ValueError("a prompt of token ids is empty; send at least one id")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError(
                "suffix (insertion) is not supported: the served model has no fill-in-the-middle"
                " format here; put all the text in the prompt"
            )
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value != n:
            raise ValueError(
                f"best_of is {value} and n is {n}: this server returns every sequence it "
                "generates, so best_of must equal n (or be left out)"
            )
        return value

    def prompts(self) -> list[Prompt]:
        """Each prompt of the request, as text or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and isinstance(self.prompt[0], int):
            return [list(self.prompt)]
        return list(self.prompt)

    @property
    def choices(self) -> int:
        return len(self.prompts()) * self.n

    def sampling(self, index: int, defaults: GenerationDefaults | None = None) -> SamplingParams:
        params = super().sampling(index, defaults)
        if not self.echo:
            return params
        # The prompt's logprobs are the same for its n choices: the first computes them, the
        # others borrow them (api/endpoints/completions.py) and may take the prompt from the
        # prefix cache.
        first_of_prompt = index % self.n == 0
        prompt_logprobs = self.logprobs if first_of_prompt else None
        return msgspec.structs.replace(params, echo=True, prompt_logprobs=prompt_logprobs)
