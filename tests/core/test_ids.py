"""Request ids: their form, no repeats across batches and threads, none shared with a forked child."""

from __future__ import annotations

import os
import re

import pytest

from pdrouter.core import ids
from pdrouter.core.ids import new_request_id

from .racing import run_racing

FORM = re.compile(r"req-[0-9a-f]{32}")


def test_form_and_no_repeat_across_batches() -> None:
    made = [new_request_id() for _ in range(5 * ids._ID_BATCH + 3)]
    assert all(FORM.fullmatch(rid) for rid in made)
    assert len(set(made)) == len(made)


def test_threads_never_share_an_id() -> None:
    out: list[list[str]] = [[] for _ in range(4)]

    def draw(into: list[str]) -> None:
        for _ in range(3 * ids._ID_BATCH):
            into.append(new_request_id())

    run_racing(draw, [(into,) for into in out])
    every = [rid for into in out for rid in into]
    assert len(every) == 4 * 3 * ids._ID_BATCH
    assert len(set(every)) == len(every)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_draws_its_own() -> None:
    new_request_id()  # the parent holds a drawn batch now
    assert ids._ids
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert FORM.fullmatch(child)
    assert child not in ids._ids  # not one of the parent's pending ids
    assert child != new_request_id()
