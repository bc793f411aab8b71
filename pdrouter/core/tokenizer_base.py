"""What every tokenizer of the project is: the :class:`Tokenizer` protocol, chat prompts, the folder's file names.

Shared by the byte-level tokenizer (``pdrouter.core.tokenizer``) and the HF one
(``pdrouter.core.hf_tokenizer``); imports neither, nor ``tokenizers`` or ``jinja2``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from pdrouter.core.chat_template import ChatMessage, ChatOptions, ChatTemplate
from pdrouter.core.errors import ConfigError, InvalidRequestError

HF_TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens of ``tokenizer_config.json`` that a chat template sees as variables."""


class StreamDecoder(Protocol):
    """Turns a stream of token ids into text, holding back incomplete UTF-8 sequences."""

    def push(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class Tokenizer(Protocol):
    """What the router and the workers need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation (``eos_token_id`` first)."""
        ...

    @property
    def special_tokens(self) -> Mapping[str, str]:
        """Named special tokens as text (``{"bos_token": "<s>", …}``): a chat template's variables."""
        ...

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The folder's chat template (compiled on first use; ConfigError if it does not compile)."""
        ...

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def encode_prompt(self, text: str) -> Sequence[int]:
        """``encode(text)`` as a request keeps it: a tuple, or packed (``PackedPrompt``) where the
        tokenizer makes the packed form at once."""
        ...

    def encode_chat(self, text: str) -> list[int]:
        """Ids of a rendered chat template: special tokens in the text are their ids, nothing is added."""
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def stream_decoder(self) -> StreamDecoder: ...


def apply_chat_template(tokenizer: Tokenizer, messages: Sequence[ChatMessage], options: ChatOptions | None = None,
                        template: ChatTemplate | None = None) -> list[int]:
    """Prompt ids of a chat: ``template`` (default: the tokenizer's own) rendered, then ``encode_chat``.

    InvalidRequestError when there is no template or the template refuses the request."""
    template = template if template is not None else tokenizer.chat_template
    if template is None:
        raise InvalidRequestError("this model has no chat template")
    text = template.render(messages, options if options is not None else ChatOptions(), tokenizer.special_tokens)
    return tokenizer.encode_chat(text)


def dict_messages(messages: Sequence[Mapping[str, Any]]) -> list[ChatMessage]:
    return [ChatMessage.from_mapping(m) for m in messages]


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data
