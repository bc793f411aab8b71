"""Streaming detokenization on a byte-fallback BPE, stop strings as vLLM applies them, and eos ids.

The stream decoder is checked against full decodes: whatever the chunking, the pieces add up to
``decode(ids)``, and a character split over byte-fallback tokens comes out once, whole. Stop
strings are checked against a token-by-token reference of vLLM's rule (after each token, look for
a stop string in the text so far; cut before it, or after it with ``include_stop_str_in_output``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.hf_tokenizer import HfTokenizer, read_eos_token_ids
from pdrouter.core.sampling import SamplingParams
from pdrouter.core.tokenizer import ByteTokenizer, load_tokenizer
from pdrouter.engine.model_folder import read_model_folder
from pdrouter.engine.sim.config import SimEngineConfig
from pdrouter.engine.sim.engine import SimEngine
from pdrouter.router.frontdoor.detokenize import TextStream

from .hf_folders import write_hf_folder

pytest.importorskip("tokenizers")

TEXTS = ["héllo 世界 😀", "a 😀😀 b", "the quick brown fox 🦊 jumps", "🦊", "x\u00e9\u0301 ok 👩‍💻 done"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_folder(tmp_path_factory.mktemp("m") / "llama3", "llama3",
                           generation_eos=["<|eot_id|>", "<|im_end|>", "</s>"])


@pytest.fixture(scope="module")
def tok(folder: Path) -> HfTokenizer:
    tokenizer = load_tokenizer(folder)
    assert isinstance(tokenizer, HfTokenizer)
    return tokenizer


def chunked(ids: list[int], rng: random.Random) -> list[list[int]]:
    """``ids`` cut into random runs of 1 to 4 tokens."""
    out, at = [], 0
    while at < len(ids):
        n = rng.randint(1, 4)
        out.append(ids[at:at + n])
        at += n
    return out


def stream_text(tok: HfTokenizer, pieces: list[list[int]]) -> list[str]:
    dec = tok.stream_decoder()
    return [dec.push(p) for p in pieces] + [dec.flush()]


# -- streaming detokenization ---------------------------------------------------------------------


def test_a_character_over_byte_fallback_tokens_comes_out_once_and_whole(tok: HfTokenizer) -> None:
    ids = tok.encode("a 😀 b", add_bos=False)
    assert len(ids) >= 6  # "a", " ", four byte-fallback tokens for 😀, " b"
    out = stream_text(tok, [[t] for t in ids])
    assert "".join(out) == tok.decode(ids) == "a 😀 b"
    assert "😀" in out and not any("\ufffd" in piece for piece in out)


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_add_up_to_the_full_decode_for_any_chunking(tok: HfTokenizer, text: str) -> None:
    ids = tok.encode(text, add_bos=False)
    rng = random.Random(text)
    for _ in range(20):
        out = stream_text(tok, chunked(ids, rng))
        assert "".join(out) == tok.decode(ids) == text
        assert not any("\ufffd" in piece for piece in out)


def test_special_tokens_are_skipped_as_in_a_full_decode(tok: HfTokenizer) -> None:
    ids = tok.encode_chat("<|start_header_id|>héllo<|eot_id|> 😀<|eot_id|>")
    out = stream_text(tok, [[t] for t in ids])
    assert "".join(out) == tok.decode(ids) and "😀" in out and "<" not in "".join(out)


def test_an_unfinished_character_at_the_end_decodes_as_a_full_decode(tok: HfTokenizer) -> None:
    ids = tok.encode("ok 😀", add_bos=False)[:-1]  # the last byte of 😀 never comes
    out = stream_text(tok, [[t] for t in ids])
    assert out[-1].endswith("\ufffd") and "".join(out) == tok.decode(ids)


def test_random_ids_stream_as_they_decode_and_bad_bytes_never_break_the_stream(tok: HfTokenizer) -> None:
    """Random ids (as a simulated worker samples them) are often bytes that are not UTF-8: the stream
    goes on, with U+FFFD for them. Where a full decode is valid text, the stream equals it."""
    rng = random.Random(7)
    valid = 0
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 24))]
        full = tok.decode(ids)
        out = "".join(stream_text(tok, chunked(ids, rng)))
        if "\ufffd" not in full:
            valid += 1
            assert out == full
        else:
            assert "\ufffd" in out
    assert valid > 20


def test_a_valid_character_before_a_stray_byte_is_kept(tok: HfTokenizer, folder: Path) -> None:
    byte = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]["<0x80>"]
    ids = [*tok.encode("ok", add_bos=False), *tok.encode("😀", add_bos=False)[-4:], byte]
    ids += tok.encode("x", add_bos=False)
    out = "".join(stream_text(tok, [[t] for t in ids]))
    assert out == "ok😀\ufffd x"
    assert tok.decode(ids) == "ok" + "\ufffd" * 5 + " x"  # a full decode gives up on the whole byte run


# -- stop strings ---------------------------------------------------------------------------------


def vllm_reference(tok: HfTokenizer, ids: list[int], stops: tuple[str, ...], include: bool) -> str:
    """vLLM's rule, token by token: the output once a stop string appears, or the whole text."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k]).rstrip("\ufffd")
        found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
        if found:
            end, start, _ = min(found, key=lambda f: (f[0], f[1]))
            return text[:end] if include else text[:start]
    return tok.decode(ids)


@pytest.mark.parametrize("include", [False, True], ids=["stop-left-out", "stop-included"])
@pytest.mark.parametrize(("text", "stops"), [
    ("the quick brown fox jumps over the lazy dog", ("brown fox",)),   # spans several tokens
    ("the quick brown fox jumps over the lazy dog", ("k b", "zzz")),   # starts inside a token
    ("héllo 世界 😀 after", ("😀",)),                                  # a character over byte tokens
    ("héllo 世界 😀 after", ("界 😀 a",)),
    ("a 😀😀 b", ("😀 b", "😀😀")),                                      # the one completed first wins
    ("hello world, hello there", ("there", "hello")),
    ("hello world", ("not in the text",)),
])
def test_stop_strings_cut_as_vllm_does(tok: HfTokenizer, text: str, stops: tuple[str, ...], include: bool) -> None:
    ids = tok.encode(text, add_bos=False)
    want = vllm_reference(tok, ids, stops, include)
    rng = random.Random(f"{text}{stops}")
    for pieces in [[[t] for t in ids], [ids], *(chunked(ids, rng) for _ in range(10))]:
        stream = TextStream(tok.stream_decoder(), stops, include_stop_str_in_output=include)
        emitted = ""
        for piece in pieces:
            emitted += stream.push(piece)
            assert want.startswith(emitted)  # nothing is emitted that a later token takes back
            if stream.stopped:
                break
        emitted += stream.flush()
        assert emitted == want
        assert stream.stopped == any(s in text for s in stops)


def test_exact_cuts(tok: HfTokenizer) -> None:
    def run(text: str, stops: tuple[str, ...], include: bool = False) -> str:
        stream = TextStream(tok.stream_decoder(), stops, include_stop_str_in_output=include)
        return "".join(stream.push([t]) for t in tok.encode(text, add_bos=False)) + stream.flush()

    assert run("héllo 世界 😀 after", ("😀",)) == "héllo 世界 "
    assert run("héllo 世界 😀 after", ("😀",), include=True) == "héllo 世界 😀"
    assert run("the quick brown fox", ("brown",), include=True) == "the quick brown"
    assert run("the quick brown fox", ("brown",)) == "the quick "


@pytest.mark.parametrize(("stops", "want"), [((", th",), "one, two, th"), (("one",), "one"), (("e, t",), "one, t"),
                                              (("zzzz", "ne"), "one")])
def test_included_stop_strings_byte_by_byte(stops: tuple[str, ...], want: str) -> None:
    stream = TextStream(ByteTokenizer().stream_decoder(), stops, include_stop_str_in_output=True)
    out = [stream.push([b]) for b in b"one, two, three"]
    assert "".join(out) == want and stream.stopped
    assert out[:len(want)] == list(want)  # nothing is held back when the stop string is kept


def test_held_back_text_is_at_most_the_longest_stop_less_one(tok: HfTokenizer) -> None:
    ids = tok.encode("the quick brown fox", add_bos=False)
    stream = TextStream(tok.stream_decoder(), ("quick brown", "qx"))
    emitted, held = "", []
    for k, t in enumerate(ids, 1):
        emitted += stream.push([t])
        if stream.stopped:
            break
        held.append(len(tok.decode(ids[:k])) - len(emitted))
    assert emitted == "the " and stream.stopped
    assert 0 < max(held) <= len("quick brown") - 1  # the tokens end inside "quick brown" on the way
    tail_only = TextStream(tok.stream_decoder(), ("qx",))
    assert tail_only.push(tok.encode("the q", add_bos=False)) == "the "  # only "q" could start a stop
    assert tail_only.flush() == "q" and not tail_only.stopped


# -- eos ids ----------------------------------------------------------------------------------------


def test_eos_ids_come_from_config_generation_config_and_tokenizer_config(folder: Path, tok: HfTokenizer) -> None:
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    eot, im_end, eos = vocab["<|eot_id|>"], vocab["<|im_end|>"], vocab["</s>"]
    assert read_eos_token_ids(folder) == (eot, im_end, eos)  # config.json's eot, then the generation list
    assert read_model_folder(folder).eos_token_ids == tok.eos_token_ids == (eot, im_end, eos)
    assert tok.eos_token_id == eot
    config = json.loads((folder / "config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": im_end}))  # an int
    try:
        assert read_eos_token_ids(folder) == (config["eos_token_id"], im_end)
    finally:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, im_end, eos]}))


def test_every_eos_id_of_the_folder_stops_generation(folder: Path) -> None:
    model = read_model_folder(folder)
    assert len(model.eos_token_ids) == 3
    for eos in model.eos_token_ids:  # a simulated GPU that only ever samples this id
        engine = SimEngine(SimEngineConfig(spec=model.spec, gpu=get_gpu_preset("h100"), model_dir=folder,
                                           eos_token_ids=model.eos_token_ids, time_scale=0.0, num_blocks=16,
                                           token_range=(eos, eos + 1)))
        assert engine.generate([[20, 21, 22]], SamplingParams(max_tokens=5, temperature=0.0)) == [[eos]]
        ignored = engine.generate([[20, 21, 22]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        assert ignored == [[eos] * 5]
