"""Tokenizers: the shipped byte-level one, HF tokenizer.json, streaming decode."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from pdrouter.core.errors import ConfigError, InvalidRequestError
from pdrouter.core.hf_tokenizer import HfTokenizer
from pdrouter.core.tokenizer import SPECIAL_TOKENS, ByteTokenizer, load_tokenizer
from pdrouter.core.tokens import PackedPrompt, pack_token_ids
from pdrouter.wire.convert import unpack_token_ids


def test_byte_tokenizer_round_trips_text_and_marks_specials(tiny_dir: Path) -> None:
    tok = load_tokenizer(tiny_dir)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 512
    ids = tok.encode("héllo ✓")
    assert ids[0] == tok.bos_token_id == 257 and tok.eos_token_id == 258
    assert ids[1:] == list("héllo ✓".encode())
    assert tok.decode(ids) == "héllo ✓"
    assert tok.decode([*ids, 258, 300], skip_special_tokens=False) == "<bos>héllo ✓<eos><reserved_300>"
    assert tok.encode("a", add_bos=False) == [97]


def test_chat_template() -> None:
    tok = ByteTokenizer()
    ids = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    s = SPECIAL_TOKENS
    assert ids == [s["<bos>"], s["<|system|>"], *b"be brief", s["<|end|>"], s["<|user|>"], *b"hi", s["<|end|>"],
                   s["<|assistant|>"]]
    with pytest.raises(InvalidRequestError, match="role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_stream_decoder_holds_back_partial_characters() -> None:
    dec = ByteTokenizer().stream_decoder()
    data = list("a✓".encode())  # 'a' then a 3-byte character
    assert dec.push(data[:2]) == "a"
    assert dec.push(data[2:3]) == ""
    assert dec.push([*data[3:], 258]) == "✓"
    assert dec.push([0xE2]) == "" and dec.flush() == "\ufffd"


def test_too_small_vocabulary_is_refused() -> None:
    with pytest.raises(ConfigError):
        ByteTokenizer(vocab_size=200)


def test_hf_tokenizer_json_is_preferred(tiny_dir: Path, tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path / "with-hf"
    shutil.copytree(tiny_dir, folder)
    for name in ("tokenizer_config.json", "chat_template.jinja"):  # the byte tokenizer's HF rendering's
        (folder / name).unlink()
    vocab = {"<unk>": 0, "hello": 1, "world": 2}
    model = tokenizers.models.WordLevel(vocab, unk_token="<unk>")
    raw = tokenizers.Tokenizer(model)
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    raw.decoder = tokenizers.decoders.WordPiece()
    raw.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = [2, 0]
    (folder / "config.json").write_text(json.dumps(config))
    tok = load_tokenizer(folder)
    assert isinstance(tok, HfTokenizer)
    assert tok.encode("hello world") == [257, 1, 2] and tok.eos_token_id == 2
    assert tok.decode([1, 2]) == "hello world"
    dec = tok.stream_decoder()
    assert dec.push([1]) + dec.push([2]) + dec.flush() == "hello world"


def test_folder_without_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tokenizer"):
        load_tokenizer(tmp_path)


def test_byte_tokenizer_packed_encoding_equals_encode_then_pack() -> None:
    rng = random.Random(7)
    tok = ByteTokenizer()
    texts = ["", "a", "\x00", "\x00\x00", "~" * 3, "é中🙂", "\x7f\x80"]
    texts += ["".join(chr(rng.choice([rng.randrange(0, 128), rng.randrange(128, 0x3000)])) for _ in range(n))
              for n in rng.choices(range(0, 300), k=300)]
    for text in texts:
        for add_bos in (True, False):
            plain = tok.encode(text, add_bos=add_bos)
            packed = tok.encode_prompt(text, add_bos=add_bos)
            assert type(packed) is PackedPrompt
            assert list(packed) == plain
            assert packed.packed == pack_token_ids(plain)
            assert packed.largest == max(plain, default=-1)
            assert unpack_token_ids(packed.packed) == packed == tuple(plain) and hash(packed) == hash(tuple(plain))
            assert packed[1:3] == tuple(plain[1:3]) and len(packed) == len(plain)


def test_a_packed_prompt_slices_as_its_tuple_unpacking_only_the_slice() -> None:
    rng = random.Random(5)
    ids = tuple(rng.randrange(2**32) for _ in range(37))
    bounds = [None, -40, -37, -5, -1, 0, 1, 5, 36, 37, 50]
    for start in bounds:
        for stop in bounds:
            for step in (None, 1, 2, -1):
                prompt = PackedPrompt(pack_token_ids(ids), max(ids))
                part = prompt[start:stop:step]
                assert part == ids[start:stop:step], (start, stop, step)
                assert type(part) is tuple and all(type(i) is int for i in part)
    prompt = PackedPrompt(pack_token_ids(ids), max(ids))
    assert prompt[3:20] == ids[3:20] and prompt[-1] == ids[-1]
    assert prompt == ids and hash(prompt) == hash(ids)  # read whole once read one by one
