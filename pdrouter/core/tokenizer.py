"""Tokenizers: the byte-level one the project ships with its random models, and HF ``tokenizer.json``.

:func:`load_tokenizer` picks, for a model folder:

* ``tokenizer.json`` (HF ``tokenizers`` format) when the file exists and ``tokenizers`` is importable;
* otherwise ``pdrouter_tokenizer.json``, the byte-level tokenizer written by ``make_model``.

Byte-level vocabulary: ids 0–255 are the raw UTF-8 bytes, then the specials of :data:`SPECIAL_TOKENS`;
ids above them up to the model's vocabulary size are reserved and never produced by ``encode``.
This module imports no torch, so the router can tokenize with it cheaply.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from pdrouter.core.errors import ConfigError, InvalidRequestError

BYTE_TOKENIZER_FILE = "pdrouter_tokenizer.json"
HF_TOKENIZER_FILE = "tokenizer.json"

SPECIAL_TOKENS: dict[str, int] = {
    "<pad>": 256,
    "<bos>": 257,
    "<eos>": 258,
    "<|system|>": 259,
    "<|user|>": 260,
    "<|assistant|>": 261,
    "<|end|>": 262,
}
_ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}


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

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            add_generation_prompt: bool = True) -> list[int]: ...

    def stream_decoder(self) -> StreamDecoder: ...


class _ByteStreamDecoder:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: Sequence[int]) -> str:
        return self._decoder.decode(bytes(t for t in token_ids if 0 <= t < 256))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class ByteTokenizer:
    """UTF-8 bytes plus a handful of specials (``<bos>``, ``<eos>``, ``<pad>``, chat markers)."""

    def __init__(self, vocab_size: int = 512, special_tokens: Mapping[str, int] | None = None) -> None:
        self._specials = dict(special_tokens or SPECIAL_TOKENS)
        needed = max(self._specials.values(), default=255) + 1
        if vocab_size < max(needed, 256):
            raise ConfigError(f"byte tokenizer needs a vocabulary of at least {needed}, got {vocab_size}")
        self._vocab_size = vocab_size
        self._names = {v: k for k, v in self._specials.items()}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._specials.get("<bos>")

    @property
    def eos_token_id(self) -> int | None:
        return self._specials.get("<eos>")

    @property
    def pad_token_id(self) -> int | None:
        return self._specials.get("<pad>")

    def token_id(self, name: str) -> int:
        """Id of a special token by name (``"<eos>"``)."""
        if name not in self._specials:
            raise KeyError(f"no special token {name!r}")
        return self._specials[name]

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        bos = self.bos_token_id
        return [bos, *ids] if add_bos and bos is not None else ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        parts: list[str] = []
        run = bytearray()
        for t in token_ids:
            if 0 <= t < 256:
                run.append(t)
                continue
            if not skip_special_tokens:
                parts.append(run.decode("utf-8", errors="replace"))
                run.clear()
                parts.append(self._names.get(t, f"<reserved_{t}>"))
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            add_generation_prompt: bool = True) -> list[int]:
        """``<bos>`` then ``<|role|> content <|end|>`` per message, then ``<|assistant|>``."""
        ids = [self.token_id("<bos>")]
        for message in messages:
            role = message.get("role", "")
            if role not in _ROLE_TOKENS:
                raise InvalidRequestError(f"unknown chat role {role!r}; use one of {sorted(_ROLE_TOKENS)}")
            ids.append(self.token_id(_ROLE_TOKENS[role]))
            ids.extend(message.get("content", "").encode("utf-8"))
            ids.append(self.token_id("<|end|>"))
        if add_generation_prompt:
            ids.append(self.token_id("<|assistant|>"))
        return ids

    def stream_decoder(self) -> StreamDecoder:
        return _ByteStreamDecoder()

    def to_json(self) -> dict[str, Any]:
        return {"type": "byte", "vocab_size": self._vocab_size, "special_tokens": self._specials,
                "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}

    def save(self, folder: Path) -> Path:
        path = folder / BYTE_TOKENIZER_FILE
        path.write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")
        return path


class _HfStreamDecoder:
    """Re-decodes the tail of the stream; emits text once it no longer ends in a partial character."""

    def __init__(self, tokenizer: HfTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._emitted = 0

    def push(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        new, self._emitted = text[self._emitted:], len(text)
        return new

    def flush(self) -> str:
        text = self._tok.decode(self._ids)
        new, self._emitted = text[self._emitted:], len(text)
        return new


class HfTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` package."""

    def __init__(self, path: Path, bos_token_id: int | None, eos_token_id: int | None) -> None:
        from tokenizers import Tokenizer as _RawTokenizer

        self._tok = _RawTokenizer.from_file(str(path))
        self._bos = bos_token_id
        self._eos = eos_token_id

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        return [self._bos, *ids] if add_bos and self._bos is not None else ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            add_generation_prompt: bool = True) -> list[int]:
        """A plain ``role: content`` transcript (the folder's Jinja chat template is not evaluated)."""
        text = "".join(f"{m.get('role', '')}: {m.get('content', '')}\n" for m in messages)
        if add_generation_prompt:
            text += "assistant: "
        return self.encode(text)

    def stream_decoder(self) -> StreamDecoder:
        return _HfStreamDecoder(self)


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of a model folder (see the module docstring for the order of preference)."""
    folder = Path(model_dir)
    config: dict[str, Any] = {}
    if (folder / "config.json").is_file():
        config = json.loads((folder / "config.json").read_text())
    if (folder / HF_TOKENIZER_FILE).is_file():
        try:
            return HfTokenizer(folder / HF_TOKENIZER_FILE, _first_id(config.get("bos_token_id")),
                               _first_id(config.get("eos_token_id")))
        except ImportError:
            pass
    byte_file = folder / BYTE_TOKENIZER_FILE
    if byte_file.is_file():
        data = json.loads(byte_file.read_text())
        specials = {str(k): int(v) for k, v in data["special_tokens"].items()}
        return ByteTokenizer(int(data["vocab_size"]), specials)
    raise ConfigError(f"{folder} has no usable tokenizer ({HF_TOKENIZER_FILE} with the tokenizers "
                      f"package, or {BYTE_TOKENIZER_FILE})")
