"""A ``make-model`` folder's HF tokenizer gives the byte tokenizer's ids: transformers, ``tokenizers`` and the
router's own HF loader agree with ``ByteTokenizer`` on text, chat prompts and decoding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdrouter.core.hf_tokenizer import HfTokenizer
from pdrouter.core.tokenizer import SPECIAL_TOKENS, ByteTokenizer, load_tokenizer
from pdrouter.engine.model_folder import write_config_folder

pytest.importorskip("tokenizers")

_NO_SPECIAL_TEXT = st.text(max_size=200).filter(
    lambda t: "<reserved_" not in t and not any(s in t for s in SPECIAL_TOKENS))
"""Any text but one that spells an added token (a special or ``<reserved_N>``): HF tokenizers read those as
the token in any text, the byte tokenizer only in chat prompts (see ``pdrouter.core.byte_hf_tokenizer``)."""

TEXTS = ["hello world", "héllo ✓ 日本語 🙂", "  two spaces\n\ttab\r\n", "", "a" * 300, "\x00\x01\x7f\x80",
         "Ġ Ċ ĉ", "<reserved < bos > <eo <|user", "\ufffd\U0010ffff"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdrouter.core.model_spec import get_model_preset

    return write_config_folder(get_model_preset("tiny"), tmp_path_factory.mktemp("byte-hf") / "m", hf_tokenizer=True)


@pytest.fixture(scope="module")
def byte(folder: Path) -> ByteTokenizer:
    tok = load_tokenizer(folder)
    assert isinstance(tok, ByteTokenizer), "the folder's own HF rendering must not replace the byte tokenizer"
    return tok


@pytest.fixture(scope="module")
def auto(folder: Path) -> object:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def test_folder_files(folder: Path) -> None:
    names = {p.name for p in folder.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "pdrouter_tokenizer.json"} <= names
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<bos>", "<eos>", "<pad>")


@pytest.mark.parametrize("text", TEXTS)
def test_text_ids_agree(text: str, byte: ByteTokenizer, auto: object, folder: Path) -> None:
    want = byte.encode(text)
    assert auto(text)["input_ids"] == want  # type: ignore[operator]
    hf = HfTokenizer(folder / "tokenizer.json", tokenizer_config=json.loads((folder / "tokenizer_config.json")
                                                                             .read_text()))
    assert hf.encode(text) == want
    assert hf.encode(text, add_bos=False) == byte.encode(text, add_bos=False)


@settings(max_examples=300, deadline=None)
@given(text=_NO_SPECIAL_TEXT)
def test_any_text_agrees(text: str, byte: ByteTokenizer, auto: object) -> None:
    assert auto(text)["input_ids"] == byte.encode(text)  # type: ignore[operator]


def test_chat_prompts_agree(byte: ByteTokenizer, auto: object) -> None:
    for messages in ([{"role": "user", "content": "hi"}],
                     [{"role": "system", "content": "be brief"}, {"role": "user", "content": "é <eos> ✓"},
                      {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]):
        got = auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)  # type: ignore[attr-defined]
        ids = got["input_ids"] if hasattr(got, "keys") else got
        assert list(ids) == byte.apply_chat_template(messages)


def test_decode_agrees(byte: ByteTokenizer, auto: object) -> None:
    ids = [*"grüße ✓".encode(), 258, *range(250, 300), *b"end"]
    assert auto.decode(ids, skip_special_tokens=True) == byte.decode(ids)  # type: ignore[attr-defined]
    assert auto.decode([257, 260, *b"x", 262], skip_special_tokens=False) == byte.decode(  # type: ignore[attr-defined]
        [257, 260, *b"x", 262], skip_special_tokens=False)
    assert auto.eos_token_id == byte.eos_token_id and auto.bos_token_id == byte.bos_token_id  # type: ignore[attr-defined]
    assert len(auto) == byte.vocab_size  # type: ignore[arg-type]


def test_a_changed_tokenizer_json_is_read_as_hf(folder: Path, tmp_path: Path) -> None:
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    data = json.loads((copy / "tokenizer.json").read_text())
    data["post_processor"] = None  # no <bos> in front any more
    (copy / "tokenizer.json").write_text(json.dumps(data))
    tok = load_tokenizer(copy)
    assert isinstance(tok, HfTokenizer)
    assert tok.encode("ab", add_bos=False) == [97, 98]
