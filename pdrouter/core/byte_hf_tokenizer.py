"""The byte-level tokenizer as an HF tokenizer: ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``.

A model folder written by ``pdrouter make-model`` carries these beside its own
``pdrouter_tokenizer.json`` so that any HF consumer (transformers' ``AutoTokenizer``, vLLM's own
server) serves text and chat from the same folder, with the same ids as the router:

* ids 0–255 are the UTF-8 bytes, each a token of its own: a byte-level BPE vocabulary (each byte
  written as GPT-2's printable stand-in character) with no merges, so nothing joins two bytes;
* the byte tokenizer's specials (``<pad>`` 256, ``<bos>`` 257, ``<eos>`` 258, the chat markers) and
  every reserved id above them up to the vocabulary size (``<reserved_N>``) are added special tokens,
  so a full decode skips them as the byte tokenizer does;
* a post-processor puts ``<bos>`` in front, as ``ByteTokenizer.encode`` does (``add_special_tokens``);
* the chat template is the byte tokenizer's own (``BYTE_CHAT_TEMPLATE``).

One difference is inherent to HF tokenizers: they read an added token's text as that token in
*any* text, so a completion prompt that contains ``<eos>`` (or ``<reserved_300>``) literally becomes
that id there, while
``ByteTokenizer.encode`` keeps plain text as bytes (it reads specials only in chat prompts,
``encode_chat``, where both agree). ``tests/core/test_byte_hf_tokenizer.py`` checks the agreement.

``pdrouter_tokenizer.json`` records the SHA-256 of the ``tokenizer.json`` written with it; while the
two match, ``load_tokenizer`` keeps using the byte tokenizer (same ids, no ``tokenizers`` call on
the router's path). Imports ``tokenizers`` only when writing.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pdrouter.core.chat_template import CHAT_TEMPLATE_FILE
from pdrouter.core.tokenizer_base import HF_TOKENIZER_FILE, TOKENIZER_CONFIG_FILE


def byte_stand_ins() -> list[str]:
    """The printable character that stands for each byte 0–255 in a byte-level BPE vocabulary.

    Bytes that are printable Latin-1 characters stand for themselves; the others (controls, space,
    and a few more) take the code points from 256 on, in byte order. This is the mapping GPT-2 and
    ``tokenizers``' ``ByteLevel`` pre-tokenizer and decoder use.
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(
        range(ord("®"), ord("ÿ") + 1))
    out: list[str] = []
    extra = 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def hf_tokenizer_json(vocab_size: int, special_tokens: dict[str, int], bos_token: str | None) -> str:
    """The serialized ``tokenizers`` tokenizer (see the module docstring for what it holds)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {char: b for b, char in enumerate(byte_stand_ins())}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    named = {token_id: text for text, token_id in special_tokens.items()}
    added = []
    for token_id in range(256, vocab_size):
        text = named.get(token_id, f"<reserved_{token_id}>")
        added.append(AddedToken(text, special=True, normalized=False))
    # Added tokens take the next ids in order: 256, 257, … exactly as listed.
    raw.add_special_tokens(added)
    for text, token_id in special_tokens.items():
        if raw.token_to_id(text) != token_id:  # pragma: no cover - the order above guarantees it
            raise AssertionError(f"{text} got id {raw.token_to_id(text)}, want {token_id}")
    if bos_token is not None:
        raw.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B",
            special_tokens=[(bos_token, special_tokens[bos_token])])
    return str(raw.to_str(pretty=True)) + "\n"


def hf_tokenizer_config(special_names: dict[str, str], model_max_length: int) -> dict[str, Any]:
    """``tokenizer_config.json``: the fast tokenizer class, named specials, the context length."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": False, **special_names}


def write_hf_files(folder: Path, *, vocab_size: int, special_tokens: dict[str, int], special_names: dict[str, str],
                   chat_template: str, model_max_length: int) -> str:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja``; the SHA-256
    (hex) of ``tokenizer.json``."""
    text = hf_tokenizer_json(vocab_size, special_tokens, special_names.get("bos_token"))
    (folder / HF_TOKENIZER_FILE).write_text(text, encoding="utf-8")
    config = hf_tokenizer_config(special_names, model_max_length)
    (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (folder / CHAT_TEMPLATE_FILE).write_text(chat_template, encoding="utf-8")
    return file_sha256(folder / HF_TOKENIZER_FILE)


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
