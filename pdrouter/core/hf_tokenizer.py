"""HF tokenizers: a ``tokenizer.json`` with its ``tokenizer_config.json``, streamed decoding, EOS ids.

Loaded by ``pdrouter.core.tokenizer.load_tokenizer`` for a folder with a ``tokenizer.json``;
imports ``tokenizers`` only when a tokenizer is built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from pdrouter.core.chat_template import ChatOptions, ChatTemplate, TemplateSource
from pdrouter.core.errors import ConfigError
from pdrouter.core.tokenizer_base import (
    GENERATION_CONFIG_FILE,
    HF_TOKENIZER_FILE,
    SPECIAL_TOKEN_NAMES,
    TOKENIZER_CONFIG_FILE,
    StreamDecoder,
    apply_chat_template,
    dict_messages,
    read_json,
)


class _HfStreamDecoder:
    """Incremental decoding of an HF tokenizer's ids: text once a token completes it, never half a character.

    The text of a window of ids (from the emission boundary before the last one) is decoded, and
    what it adds to the text of the window's already-emitted part is the new text; a window whose
    text ends in U+FFFD (a character still missing bytes) or adds nothing (special tokens) waits for
    more ids. For valid text the pieces add up to the full decode. ``tokenizers``' ``DecodeStream``
    does exactly this in Rust and is used until it gives up: it raises on ids that are not valid
    text (a run of byte-fallback tokens that is not UTF-8, which a full decode turns into one U+FFFD
    per byte). From then on the same steps run here, and the new ids of a window whose text does not
    extend what was emitted are decoded on their own, so the stream goes on with U+FFFD where bytes
    were bad. At the end, ids still waiting decode as a full decode would (an unfinished character
    as U+FFFD).
    """

    def __init__(self, raw: Any) -> None:
        from tokenizers.decoders import DecodeStream

        self._raw = raw
        self._stream: Any = DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []
        self._prefix = 0        # the window starts here
        self._read = 0          # ids before this have produced their text
        self._prefix_text = ""  # text of ids[_prefix:_read] (kept once DecodeStream is left)

    def push(self, token_ids: Sequence[int]) -> str:
        out: list[str] = []
        for t in token_ids:
            self._ids.append(t)
            out.append(self._fast_step(t) if self._stream is not None else self._step(final=False))
        return "".join(out)

    def flush(self) -> str:
        if self._read == len(self._ids):
            return ""
        self._leave_stream()
        return self._step(final=True)

    def _fast_step(self, token_id: int) -> str:
        try:
            piece = self._stream.step(self._raw, token_id)
        except Exception:  # tokenizers raises a bare Exception ("Invalid prefix encountered…")
            self._leave_stream()
            return self._step(final=False)
        if piece is None:
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return str(piece)

    def _leave_stream(self) -> None:
        if self._stream is not None:
            self._stream = None
            self._prefix_text = self._decode(self._prefix, self._read)

    def _decode(self, start: int, end: int) -> str:
        return str(self._raw.decode(self._ids[start:end], skip_special_tokens=True))

    def _step(self, final: bool) -> str:
        end = len(self._ids)
        text = self._decode(self._prefix, end)
        if not final and (len(text) <= len(self._prefix_text) or text.endswith("\ufffd")):
            return ""
        if text.startswith(self._prefix_text):
            piece = text[len(self._prefix_text):]
        else:
            piece = self._decode(self._read, end)
        self._prefix, self._read = self._read, end
        self._prefix_text = self._decode(self._prefix, self._read)
        return piece


def _token_text(value: Any) -> str | None:
    """A special token of ``tokenizer_config.json``: a string or an AddedToken object (its ``content``)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HfTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` package, with its ``tokenizer_config.json``."""

    def __init__(self, path: Path, *, tokenizer_config: Mapping[str, Any] | None = None,
                 model_config: Mapping[str, Any] | None = None, eos_token_ids: Sequence[int] = (),
                 chat_template_source: TemplateSource | None = None) -> None:
        from tokenizers import Tokenizer as _RawTokenizer

        self._tok = _RawTokenizer.from_file(str(path))
        self._origin = str(path.parent)
        tok_config = tokenizer_config or {}
        self._add_declared_tokens(tok_config)
        self._specials = {name: text for name in SPECIAL_TOKEN_NAMES
                          if (text := _token_text(tok_config.get(name))) is not None}
        self._add_special_tokens(self._specials.values())
        config = model_config or {}
        self._bos = self._special_id(tok_config, "bos_token", config.get("bos_token_id"))
        self._eos = self._special_id(tok_config, "eos_token", config.get("eos_token_id"))
        primary = () if self._eos is None else (self._eos,)
        self._eos_ids = tuple(dict.fromkeys((*primary, *eos_token_ids)))
        self._template_source = chat_template_source

    def _add_declared_tokens(self, tok_config: Mapping[str, Any]) -> None:
        """Add the ``added_tokens_decoder`` entries ``tokenizer.json`` lacks; ConfigError if an id disagrees."""
        from tokenizers import AddedToken

        declared = tok_config.get("added_tokens_decoder") or {}
        known = self._tok.get_added_tokens_decoder()
        for raw_id, spec in sorted(declared.items(), key=lambda item: int(item[0])):
            token_id, content = int(raw_id), _token_text(spec)
            if content is None or token_id in known:
                continue
            flags = {k: bool(spec[k]) for k in ("single_word", "lstrip", "rstrip", "normalized") if k in spec}
            token = AddedToken(content, special=bool(spec.get("special", False)), **flags)
            if spec.get("special", False):
                self._tok.add_special_tokens([token])
            else:
                self._tok.add_tokens([token])
            got = self._tok.token_to_id(content)
            if got != token_id:
                raise ConfigError(f"{self._origin}: added token {content!r} is declared with id {token_id} in "
                                  f"{TOKENIZER_CONFIG_FILE}, but {HF_TOKENIZER_FILE} gives it id {got}")

    def _add_special_tokens(self, texts: Any) -> None:
        from tokenizers import AddedToken

        known = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        missing = [AddedToken(t, special=True, normalized=False) for t in texts if t not in known]
        if missing:
            self._tok.add_special_tokens(missing)

    def _special_id(self, tok_config: Mapping[str, Any], name: str, fallback: Any) -> int | None:
        """The id of ``tokenizer_config.json``'s ``name`` token when it has the key, else ``config.json``'s."""
        if name in tok_config:
            text = self._specials.get(name)
            return None if text is None else self._tok.token_to_id(text)
        ids = _ids(fallback)
        return ids[0] if ids else None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def special_tokens(self) -> Mapping[str, str]:
        return self._specials

    @cached_property
    def chat_template(self) -> ChatTemplate | None:
        if self._template_source is None:
            return None
        return ChatTemplate(self._template_source, f"the chat template of {self._origin}")

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        return [self._bos, *ids] if add_bos and self._bos is not None else ids

    def encode_prompt(self, text: str) -> tuple[int, ...]:
        return tuple(self.encode(text))

    def encode_chat(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
                            ) -> list[int]:
        """Prompt ids of plain-dict ``messages`` with the folder's template (:func:`apply_chat_template`)."""
        return apply_chat_template(self, dict_messages(messages), ChatOptions(add_generation_prompt))

    def stream_decoder(self) -> StreamDecoder:
        return _HfStreamDecoder(self._tok)


def _ids(value: Any) -> tuple[int, ...]:
    """Token ids of a config value: an int, a list of ints, or None."""
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)


def read_eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """Every id that ends a generation for a folder, in order, without repeats.

    ``config.json``'s ``eos_token_id``, then ``generation_config.json``'s (each an int or a list),
    then ``tokenizer_config.json``'s ``eos_token`` when ``added_tokens_decoder`` names its id.
    Reads no ``tokenizer.json``, so it is cheap for the workers."""
    folder = Path(model_dir)
    ids = [*_ids(read_json(folder / "config.json").get("eos_token_id")),
           *_ids(read_json(folder / GENERATION_CONFIG_FILE).get("eos_token_id"))]
    tok_config = read_json(folder / TOKENIZER_CONFIG_FILE)
    eos_text = _token_text(tok_config.get("eos_token"))
    for raw_id, spec in (tok_config.get("added_tokens_decoder") or {}).items():
        if eos_text is not None and _token_text(spec) == eos_text:
            ids.append(int(raw_id))
    return tuple(dict.fromkeys(ids))
