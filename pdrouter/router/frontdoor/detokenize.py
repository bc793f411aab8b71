"""Incremental detokenization with stop strings, for one response stream.

The tokenizer's stream decoder turns token ids into text without splitting a character. On top
of it, :class:`TextStream` watches the text for the request's stop strings: text that could be
the beginning of a stop string is held back until the next tokens tell, and when one appears the
output is cut just before it (the stop string itself is never returned, as in OpenAI's API).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdrouter.core.tokenizer import StreamDecoder


class TextStream:
    """Text of one generation, emitted as tokens arrive, cut at the first stop string.

    Once :attr:`stopped` is set, every later call returns ``""``; the caller should stop
    generating (close the token stream) and report ``finish_reason = stop``.
    """

    __slots__ = ("_decoder", "_pending", "_stops", "stopped")

    def __init__(self, decoder: StreamDecoder, stop: Sequence[str] = ()) -> None:
        self._decoder = decoder
        self._stops = tuple(s for s in stop if s)
        self._pending = ""
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
        cut = -1
        for stop in self._stops:
            at = buf.find(stop)
            if at != -1 and (cut == -1 or at < cut):
                cut = at
        if cut != -1:
            self.stopped = True
            self._pending = ""
            return buf[:cut]
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
