"""Tokenizers: the byte-level one the project ships with its random models, and HF ``tokenizer.json``.

:func:`load_tokenizer` picks, for a model folder:

* ``tokenizer.json`` (HF ``tokenizers`` format) when the file exists and ``tokenizers`` is importable,
  with ``tokenizer_config.json``'s added tokens (``added_tokens_decoder``) and special tokens
  (``bos_token``, ``eos_token``…, strings or AddedToken objects), unless it is the byte tokenizer's
  own rendering (below);
* otherwise ``pdrouter_tokenizer.json``, the byte-level tokenizer written by ``make_model``. ``make_model``
  writes it as an HF tokenizer too (``pdrouter.core.byte_hf_tokenizer``: same ids, for vLLM and
  transformers); while that ``tokenizer.json`` is unchanged, the byte tokenizer is the one used.

Every id that ends a generation (:func:`read_eos_token_ids`) comes from ``config.json``,
``generation_config.json`` and ``tokenizer_config.json``'s ``eos_token``: an int or a list each.

A chat prompt is the folder's chat template rendered (``pdrouter.core.chat_template``), then
tokenized with :meth:`Tokenizer.encode_chat`: special and added tokens written in the text become
their ids, and nothing is added around it (transformers' ``apply_chat_template(tokenize=True)``).
The byte-level tokenizer has a template of its own, :data:`BYTE_CHAT_TEMPLATE`.

Byte-level vocabulary: ids 0–255 are the raw UTF-8 bytes, then the specials of :data:`SPECIAL_TOKENS`;
ids above them up to the model's vocabulary size are reserved and never produced by ``encode``.
This module imports no torch, and ``tokenizers`` / ``jinja2`` only when an HF tokenizer
(``pdrouter.core.hf_tokenizer``) or a chat template is loaded, so the router can tokenize with it
cheaply.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from pdrouter.core.chat_template import ChatOptions, ChatTemplate, TemplateSource, read_folder_template
from pdrouter.core.errors import ConfigError
from pdrouter.core.tokenizer_base import (
    GENERATION_CONFIG_FILE,
    HF_TOKENIZER_FILE,
    SPECIAL_TOKEN_NAMES,
    TOKENIZER_CONFIG_FILE,
    StreamDecoder,
    Tokenizer,
    apply_chat_template,
    dict_messages,
    read_json,
)
from pdrouter.core.tokens import PackedPrompt, packed_byte_ids

__all__ = ["BYTE_CHAT_TEMPLATE", "BYTE_TOKENIZER_FILE", "GENERATION_CONFIG_FILE", "HF_TOKENIZER_FILE",
           "SPECIAL_TOKENS", "SPECIAL_TOKEN_NAMES", "TOKENIZER_CONFIG_FILE", "ByteTokenizer", "StreamDecoder",
           "Tokenizer", "apply_chat_template", "load_tokenizer"]

BYTE_TOKENIZER_FILE = "pdrouter_tokenizer.json"
SPECIAL_TOKENS: dict[str, int] = {
    "<pad>": 256,
    "<bos>": 257,
    "<eos>": 258,
    "<|system|>": 259,
    "<|user|>": 260,
    "<|assistant|>": 261,
    "<|end|>": 262,
}
BYTE_CHAT_TEMPLATE = """\
{{- bos_token }}
{%- for message in messages %}
    {%- if message.role not in ('system', 'user', 'assistant') %}
        {{- raise_exception("unknown chat role '" ~ message.role ~ "': this model's chat template has the roles "
                            "system, user and assistant") }}
    {%- endif %}
    {{- '<|' ~ message.role ~ '|>' ~ (message.content or '') ~ '<|end|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>' }}
{%- endif %}
"""
"""The byte-level tokenizer's chat template: ``<bos>``, then ``<|role|>content<|end|>`` per message,
then ``<|assistant|>`` for the generation prompt."""


class _ByteStreamDecoder:
    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: Sequence[int]) -> str:
        try:
            data = bytes(token_ids)  # every id a byte: one C call
        except (ValueError, TypeError):  # a special token (or an id out of range) among them: skipped
            data = bytes(t for t in token_ids if 0 <= t < 256)
        return self._decoder.decode(data)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class ByteTokenizer:
    """UTF-8 bytes plus a handful of specials (``<bos>``, ``<eos>``, ``<pad>``, chat markers)."""

    def __init__(self, vocab_size: int = 512, special_tokens: Mapping[str, int] | None = None,
                 chat_template_source: TemplateSource | None = None) -> None:
        self._specials = dict(special_tokens or SPECIAL_TOKENS)
        needed = max(self._specials.values(), default=255) + 1
        if vocab_size < max(needed, 256):
            raise ConfigError(f"byte tokenizer needs a vocabulary of at least {needed}, got {vocab_size}")
        self._vocab_size = vocab_size
        self._names = {v: k for k, v in self._specials.items()}
        self._template_source = chat_template_source or BYTE_CHAT_TEMPLATE
        longest_first = sorted(self._specials, key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(s) for s in longest_first)) if longest_first else None

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
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        return () if eos is None else (eos,)

    @property
    def pad_token_id(self) -> int | None:
        return self._specials.get("<pad>")

    @property
    def special_tokens(self) -> Mapping[str, str]:
        named = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
        return {k: v for k, v in named.items() if v in self._specials}

    @cached_property
    def chat_template(self) -> ChatTemplate | None:
        return ChatTemplate(self._template_source, "the byte tokenizer's chat template")

    def token_id(self, name: str) -> int:
        """Id of a special token by name (``"<eos>"``)."""
        if name not in self._specials:
            raise KeyError(f"no special token {name!r}")
        return self._specials[name]

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        bos = self.bos_token_id
        return [bos, *text.encode("utf-8")] if add_bos and bos is not None else list(text.encode("utf-8"))

    def encode_prompt(self, text: str, add_bos: bool = True) -> PackedPrompt:
        """``encode``'s ids, packed (what the router sends a worker and hashes) from the text's bytes at
        once; unpacked only if something reads them."""
        return packed_byte_ids(text.encode("utf-8"), self.bos_token_id if add_bos else None)

    def encode_chat(self, text: str) -> list[int]:
        if self._special_re is None:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        at = 0
        for match in self._special_re.finditer(text):
            ids.extend(text[at:match.start()].encode("utf-8"))
            ids.append(self._specials[match.group()])
            at = match.end()
        ids.extend(text[at:].encode("utf-8"))
        return ids

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

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
                            ) -> list[int]:
        """Prompt ids of plain-dict ``messages`` with this tokenizer's template (:func:`apply_chat_template`)."""
        return apply_chat_template(self, dict_messages(messages), ChatOptions(add_generation_prompt))

    def stream_decoder(self) -> StreamDecoder:
        return _ByteStreamDecoder()

    def to_json(self) -> dict[str, Any]:
        return {"type": "byte", "vocab_size": self._vocab_size, "special_tokens": self._specials,
                "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}

    def save(self, folder: Path, hf_tokenizer_sha256: str | None = None) -> Path:
        """Write ``pdrouter_tokenizer.json``; ``hf_tokenizer_sha256``: the digest of the ``tokenizer.json``
        written from this tokenizer beside it (:meth:`save_hf`), which ``load_tokenizer`` then reads as
        this tokenizer's HF rendering."""
        path = folder / BYTE_TOKENIZER_FILE
        data = self.to_json()
        if hf_tokenizer_sha256 is not None:
            data["hf_tokenizer_sha256"] = hf_tokenizer_sha256
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        return path

    def save_hf(self, folder: Path, model_max_length: int) -> Path:
        """Write this tokenizer as an HF one too (``tokenizer.json``, ``tokenizer_config.json``,
        ``chat_template.jinja``: :mod:`pdrouter.core.byte_hf_tokenizer`), and ``pdrouter_tokenizer.json``
        naming it; the ids are the same. Returns the ``tokenizer.json`` path."""
        from pdrouter.core.byte_hf_tokenizer import write_hf_files

        template = self._template_source if isinstance(self._template_source, str) else BYTE_CHAT_TEMPLATE
        digest = write_hf_files(folder, vocab_size=self._vocab_size, special_tokens=self._specials,
                                special_names=dict(self.special_tokens), chat_template=template,
                                model_max_length=model_max_length)
        self.save(folder, hf_tokenizer_sha256=digest)
        return folder / HF_TOKENIZER_FILE


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of a model folder (see the module docstring for the order of preference)."""
    from pdrouter.core.hf_tokenizer import HfTokenizer, read_eos_token_ids

    folder = Path(model_dir)
    config = read_json(folder / "config.json")
    tok_config = read_json(folder / TOKENIZER_CONFIG_FILE)
    template = read_folder_template(folder, tok_config)
    byte_file = folder / BYTE_TOKENIZER_FILE
    byte_data = json.loads(byte_file.read_text()) if byte_file.is_file() else None
    if (folder / HF_TOKENIZER_FILE).is_file() and not _is_byte_rendering(folder, byte_data):
        try:
            return HfTokenizer(folder / HF_TOKENIZER_FILE, tokenizer_config=tok_config, model_config=config,
                               eos_token_ids=read_eos_token_ids(folder), chat_template_source=template)
        except ImportError:
            pass
    if byte_data is not None:
        specials = {str(k): int(v) for k, v in byte_data["special_tokens"].items()}
        return ByteTokenizer(int(byte_data["vocab_size"]), specials, chat_template_source=template)
    raise ConfigError(f"{folder} has no usable tokenizer ({HF_TOKENIZER_FILE} with the tokenizers "
                      f"package, or {BYTE_TOKENIZER_FILE})")


def _is_byte_rendering(folder: Path, byte_data: Mapping[str, Any] | None) -> bool:
    """Whether the folder's ``tokenizer.json`` is the byte tokenizer's own HF rendering (``save_hf``),
    unchanged since: then the byte tokenizer is used (the same ids, read without ``tokenizers``)."""
    if byte_data is None or not byte_data.get("hf_tokenizer_sha256"):
        return False
    from pdrouter.core.byte_hf_tokenizer import file_sha256

    return bool(file_sha256(folder / HF_TOKENIZER_FILE) == byte_data["hf_tokenizer_sha256"])
