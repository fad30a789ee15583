"""Request bodies of vLLM's own endpoints: runtime adapter loading (adapter_admin.py) and
/tokenize, /detokenize (routes.py). Bounded and strict as every body is (protocol_fields.py).
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from ort_lora.errors import RequestError
from ort_lora.server.limits import MAX_MESSAGES
from ort_lora.server.protocol import ChatMessage, _ChatRendering
from ort_lora.server.protocol_fields import Int, TokenIds, _Request


class LoadLoRAAdapterRequest(_Request):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)

    @field_validator("lora_path")
    @classmethod
    def _no_nul(cls, value: str) -> str:
        if "\0" in value:
            raise ValueError("a path cannot hold a NUL byte")
        return value


class UnloadLoRAAdapterRequest(_Request):
    """POST /v1/unload_lora_adapter (vLLM's body; lora_int_id is accepted and ignored)."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: Int | None = None


class TokenizeRequest(_ChatRendering):
    """POST /tokenize (vLLM's body): a prompt, or chat messages rendered as a chat request's."""

    model: str | None = Field(None, max_length=1024)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("give exactly one of prompt and messages", "prompt")
        return self


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's body)."""

    model: str | None = Field(None, max_length=1024)
    tokens: TokenIds
