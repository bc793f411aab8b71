"""Incremental detokenization and stop strings (``pdrouter.router.frontdoor.detokenize.TextStream``)."""

from __future__ import annotations

from pdrouter.core.tokenizer import ByteTokenizer
from pdrouter.router.frontdoor.detokenize import TextStream


def stream(tokenizer: ByteTokenizer, stop: tuple[str, ...] = ()) -> TextStream:
    return TextStream(tokenizer.stream_decoder(), stop)


def test_multibyte_characters_wait_for_their_last_byte(tokenizer: ByteTokenizer) -> None:
    text = stream(tokenizer)
    data = "é✓".encode()
    assert [text.push([b]) for b in data] == ["", "é", "", "", "✓"]
    assert text.flush() == ""


def test_special_tokens_produce_no_text(tokenizer: ByteTokenizer) -> None:
    text = stream(tokenizer)
    assert text.push([104, 258, 105]) == "hi"


def test_stop_string_split_across_pushes_is_cut(tokenizer: ByteTokenizer) -> None:
    text = stream(tokenizer, ("o w",))
    out = [text.push(list(piece.encode())) for piece in ("hel", "lo", " ", "wor", "ld")]
    assert out == ["hel", "l", "", "", ""]
    assert "".join(out) == "hell"
    assert text.stopped
    assert text.flush() == ""


def test_held_back_text_is_released_when_it_diverges(tokenizer: ByteTokenizer) -> None:
    text = stream(tokenizer, ("abc",))
    assert text.push(list(b"xab")) == "x"
    assert text.push(list(b"d")) == "abd"
    assert not text.stopped


def test_flush_releases_a_held_back_tail(tokenizer: ByteTokenizer) -> None:
    text = stream(tokenizer, ("zz",))
    assert text.push(list(b"abz")) == "ab"
    assert text.flush() == "z"
    assert not text.stopped


def test_the_stop_string_completed_first_wins_within_one_push(tokenizer: ByteTokenizer) -> None:
    text = stream(tokenizer, ("cd", "bcde"))
    assert text.push(list(b"abcdef")) == "ab"  # as token by token: "cd" is complete before "bcde"
    assert text.stopped


def test_the_stop_string_completed_first_wins_across_pushes(tokenizer: ByteTokenizer) -> None:
    text = stream(tokenizer, ("cd", "bcde"))
    assert text.push(list(b"abcd")) == "ab"  # "bcde" could still follow, but "cd" is complete
    assert text.stopped


def test_empty_stop_strings_are_ignored(tokenizer: ByteTokenizer) -> None:
    text = stream(tokenizer, ("",))
    assert text.push(list(b"abc")) == "abc"
