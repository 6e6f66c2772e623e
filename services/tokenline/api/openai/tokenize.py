"""Request bodies of /tokenize and /detokenize, in vLLM's shapes.

/tokenize takes a prompt (vLLM's ``TokenizeCompletionRequest``) or chat messages
(``TokenizeChatRequest``) in one model: which one is decided by the field sent, so a body with
both, or neither, is refused by name rather than matched to whichever branch parses.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenline.api.http.errors import invalid
from tokenline.api.openai.chat import ChatMessageIn, template_variables
from tokenline.api.openai.request_limits import check_messages
from tokenline.api.openai.sampling import Text, TokenId
from tokenline.api.openai.tools import MAX_TOOLS, Tool
from tokenline.protocol import ChatMessage
from tokenline.settings import Settings

# Unknown fields are refused (400 unsupported_parameter), as in the completion bodies; NaN
# and infinities too.
_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)


class TokenizeRequest(BaseModel):
    model_config = _CONFIG

    model: Text | None = None  # optional, as vLLM has it; when sent, it must be the served one
    prompt: Text | None = None
    messages: list[ChatMessageIn] | None = Field(default=None, min_length=1)
    # None: True for a prompt (as a completion tokenizes it), False for messages (the chat
    # template writes its special tokens itself, and a chat completion adds none)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[Text, Any] | None = None  # as a chat completion's

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return template_variables(value)

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    @property
    def special_tokens(self) -> bool:
        return self.add_special_tokens if self.add_special_tokens is not None else not self.is_chat

    def check(self, settings: Settings) -> None:
        """Raise a 400 naming the param for what the fields cannot mean together, or for a
        limit the server's flags set (the same ones a completion is held to)."""
        if (self.prompt is None) == (self.messages is None):
            raise invalid(
                "prompt",
                "send either prompt (text to tokenize) or messages (a chat to render with the "
                "model's chat template), exactly one of them",
            )
        if self.prompt is not None:
            for param in ("tools", "continue_final_message", "chat_template_kwargs"):
                if getattr(self, param):
                    raise invalid(param, f"{param} applies to messages only, not to a prompt")
            if "add_generation_prompt" in self.model_fields_set:  # its default means nothing here
                raise invalid(
                    "add_generation_prompt",
                    "add_generation_prompt applies to messages only, not to a prompt",
                )
            if len(self.prompt) > settings.max_prompt_chars:
                raise invalid(
                    "prompt",
                    f"the prompt is {len(self.prompt)} characters; this server allows at most "
                    f"{settings.max_prompt_chars} (--max-prompt-chars)",
                    "limit_exceeded",
                )
            return
        if self.continue_final_message and self.add_generation_prompt:
            raise invalid(
                "continue_final_message",
                "continue_final_message and add_generation_prompt cannot both be true: set "
                "add_generation_prompt to false to continue the last message",
            )
        check_messages(self.messages or [], settings)

    def wire_messages(self) -> list[ChatMessage] | None:
        return None if self.messages is None else [m.to_wire() for m in self.messages]


class DetokenizeRequest(BaseModel):
    model_config = _CONFIG

    model: Text | None = None
    tokens: list[TokenId]
