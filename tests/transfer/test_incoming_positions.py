"""Which of a transfer's blocks a frame's runs name (``IncomingTransfer.positions_of``): the common frame
over every block in order, and every other frame, resolve alike and are checked alike."""

from __future__ import annotations

import numpy as np
import pytest

from pdrouter.transfer.errors import ProtocolError
from pdrouter.transfer.incoming import IncomingTransfer
from pdrouter.transfer.lifecycle import TransferState
from pdrouter.transfer.target import TransferTarget

DST = (5, 6, 7, 2, 3, 9, 10)
SKIP = 1  # block 5 is already on the decode side: 6, 7, 2, 3, 9, 10 are sent


def incoming() -> IncomingTransfer:
    target = TransferTarget("t-1", "127.0.0.1:1", DST, "c" * 16, epoch=1, layer_start=0, layer_end=2,
                            skip_blocks=SKIP)
    return IncomingTransfer(target, deadline=None, abort_grace_s=1.0, on_finished=lambda _: None)


def runs(*pairs: tuple[int, int]) -> np.ndarray:
    return np.array(pairs, dtype=np.int64).reshape(-1, 2)


def test_a_frame_over_every_block_in_order_names_them_in_order() -> None:
    t = incoming()
    assert t.positions_of(0, 2, runs((6, 2), (2, 2), (9, 2))).tolist() == [0, 1, 2, 3, 4, 5]


def test_other_frames_name_the_positions_of_their_blocks() -> None:
    t = incoming()
    assert t.positions_of(0, 1, runs((9, 2), (2, 2), (6, 2))).tolist() == [4, 5, 2, 3, 0, 1]
    assert t.positions_of(1, 2, runs((7, 1), (3, 1))).tolist() == [1, 3]


@pytest.mark.parametrize(("frame", "why"), [
    (runs((5, 3), (2, 2), (9, 2)), "did not invite"),          # block 5 was skipped
    (runs((6, 2), (2, 2), (9, 2), (6, 1)), "names a block twice"),
    (runs((6, 2), (2, 2), (9, 3)), "did not invite"),           # one past the last
    (runs((6, 0)), "empty run"),
])
def test_frames_naming_what_was_not_asked_for_are_refused(frame: np.ndarray, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        incoming().positions_of(0, 2, frame)


@pytest.mark.parametrize("frame", [runs((6, 2), (2, 2), (9, 2)), runs((9, 2), (2, 2), (6, 2))])
def test_a_whole_frame_again_for_the_same_layers_is_refused(frame: np.ndarray) -> None:
    t = incoming()
    t._life.advance(TransferState.TRANSFERRING)  # as a bound sender's first frame finds it
    positions = t.positions_of(0, 2, frame)
    t.mark_landed(0, 2, positions, 100)
    with pytest.raises(ProtocolError, match="arrived twice"):
        t.positions_of(0, 2, frame)
    with pytest.raises(ProtocolError, match="arrived twice"):
        t.positions_of(1, 2, runs((6, 2), (2, 2), (9, 2)))
