"""Incremental detokenization with stop strings, for one response stream.

The tokenizer's stream decoder turns token ids into text without splitting a character. On top
of it, :class:`TextStream` watches the text for the request's stop strings, as vLLM does:

* the output ends at the first stop string to be completed (the one that ends earliest in the
  text; of two ending at the same place, the longer), wherever token boundaries fall in it;
* the stop string itself is left out, or kept with ``include_stop_str_in_output``; text after it
  is never returned;
* text that could still turn out to be the start of a stop string is held back (at most the
  longest stop string's length minus one characters) until the next tokens tell, so a stream
  never emits text it would have to take back. With ``include_stop_str_in_output`` nothing needs
  holding back: any prefix of a stop string is part of the output either way.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdrouter.core.tokenizer import StreamDecoder


class TextStream:
    """Text of one generation, emitted as tokens arrive, cut at the first stop string.

    Once :attr:`stopped` is set, every later call returns ``""``; the caller should stop
    generating (close the token stream) and report ``finish_reason = stop``.
    """

    __slots__ = ("_decoder", "_include_stop", "_keep", "_pending", "_stops", "_tail", "stopped")

    def __init__(self, decoder: StreamDecoder, stop: Sequence[str] = (), include_stop_str_in_output: bool = False
                 ) -> None:
        self._decoder = decoder
        self._stops = tuple(s for s in stop if s)
        self._include_stop = include_stop_str_in_output
        self._keep = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""  # held back: not emitted yet
        self._tail = ""     # with include_stop_str_in_output: the end of the emitted text, searched again
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        """The text that can be emitted now that ``token_ids`` arrived (may be ``""``)."""
        text = self._decoder.push(token_ids)
        return self._scan(text, final=False) if self._stops else text

    def flush(self) -> str:
        """The rest of the text at the end of the stream (nothing is held back any more)."""
        text = self._decoder.flush()
        return self._scan(text, final=True) if self._stops else text

    def _scan(self, text: str, final: bool) -> str:
        if self.stopped:
            return ""
        buf = self._pending + text
        seen = self._tail + buf
        start = end = -1
        for stop in self._stops:
            at = seen.find(stop)  # a string's first occurrence is also the one that ends first
            if at != -1 and (end == -1 or at + len(stop) < end or (at + len(stop) == end and at < start)):
                start, end = at, at + len(stop)
        if end != -1:
            self.stopped = True
            self._pending = self._tail = ""
            offset = len(seen) - len(buf)
            return buf[:end - offset] if self._include_stop else buf[:max(start - offset, 0)]
        if self._include_stop:
            self._tail = seen[-self._keep:] if self._keep else ""
            return buf
        hold = 0 if final else self._partial_stop_len(buf)
        self._pending = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]

    def _partial_stop_len(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that some stop string starts with."""
        longest = min(len(buf), max(len(s) for s in self._stops) - 1)
        for k in range(longest, 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
