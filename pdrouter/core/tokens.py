"""What a token stream carries, from a worker through the router to a front door.

A stream is a sequence of ``TokenDelta``: new token ids, and on the last one the reason it ended
and the request's ``Usage``. The wire layer turns worker messages into these; the front doors
turn them into their protocol's chunks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(enum.Enum):
    STOP = "stop"        # eos or a stop token / string
    LENGTH = "length"    # max_tokens or the context window
    ABORT = "abort"      # cancelled


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class TokenDelta:
    """New tokens of a stream; the last delta has ``finish_reason`` and ``usage``.

    Built for every chunk a stream delivers, so a plain slotted dataclass (a frozen one sets each
    field through ``object.__setattr__``, three times the cost): treat it as a value.
    """

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
