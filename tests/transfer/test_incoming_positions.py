"""Which of a transfer's blocks a frame's runs name (``IncomingTransfer.positions_of``): the common frame
over every block in order, and every other frame, resolve alike and are checked alike, whether a frame
is resolved in plain Python (a few blocks) or with numpy (many)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdrouter.transfer import incoming as incoming_module
from pdrouter.transfer.errors import ProtocolError
from pdrouter.transfer.incoming import IncomingTransfer
from pdrouter.transfer.lifecycle import TransferState
from pdrouter.transfer.target import TransferTarget

DST = (5, 6, 7, 2, 3, 9, 10)
SKIP = 1  # block 5 is already on the decode side: 6, 7, 2, 3, 9, 10 are sent


@pytest.fixture(autouse=True, params=["python", "numpy"])
def resolver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "numpy":  # every frame takes the path of a frame of many blocks
        monkeypatch.setattr(incoming_module, "_SMALL_FRAME_BLOCKS", 0)
    yield request.param


def incoming() -> IncomingTransfer:
    target = TransferTarget("t-1", "127.0.0.1:1", DST, "c" * 16, epoch=1, layer_start=0, layer_end=2,
                            skip_blocks=SKIP)
    return IncomingTransfer(target, deadline=None, abort_grace_s=1.0, on_finished=lambda _: None)


def runs(*pairs: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    return pairs


def test_a_frame_over_every_block_in_order_names_them_in_order() -> None:
    t = incoming()
    assert list(t.positions_of(0, 2, runs((6, 2), (2, 2), (9, 2)))) == [0, 1, 2, 3, 4, 5]


def test_other_frames_name_the_positions_of_their_blocks() -> None:
    t = incoming()
    assert list(t.positions_of(0, 1, runs((9, 2), (2, 2), (6, 2)))) == [4, 5, 2, 3, 0, 1]
    assert list(t.positions_of(1, 2, runs((7, 1), (3, 1)))) == [1, 3]


@pytest.mark.parametrize(("frame", "why"), [
    (runs((5, 3), (2, 2), (9, 2)), "did not invite"),          # block 5 was skipped
    (runs((6, 2), (2, 2), (9, 2), (6, 1)), "names a block twice"),
    (runs((6, 2), (2, 2), (9, 3)), "did not invite"),           # one past the last
    (runs((6, 0)), "empty run"),
])
def test_frames_naming_what_was_not_asked_for_are_refused(frame: tuple[tuple[int, int], ...], why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        incoming().positions_of(0, 2, frame)


@pytest.mark.parametrize("frame", [runs((6, 2), (2, 2), (9, 2)), runs((9, 2), (2, 2), (6, 2))])
def test_a_whole_frame_again_for_the_same_layers_is_refused(frame: tuple[tuple[int, int], ...]) -> None:
    t = incoming()
    t._life.advance(TransferState.TRANSFERRING)  # as a bound sender's first frame finds it
    positions = t.positions_of(0, 2, frame)
    t.mark_landed(0, 2, positions, 100)
    with pytest.raises(ProtocolError, match="arrived twice"):
        t.positions_of(0, 2, frame)
    with pytest.raises(ProtocolError, match="arrived twice"):
        t.positions_of(1, 2, runs((6, 2), (2, 2), (9, 2)))
