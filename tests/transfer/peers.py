"""Entry points of the peer processes the cross-process tests spawn (a sender or a receiver).

Each is driven over a ``multiprocessing`` pipe with small tuples and answers ``("ok", value)`` or
``("error", class name, message)``; the tests kill them with SIGKILL to play a crashed worker.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

from pdrouter.core.errors import PdRouterError
from pdrouter.transfer import Backend, KvReceiver, KvSender, TransferTarget

from .factories import make_config, make_layout, make_pool

LayoutSpec = dict[str, Any]


def sender_main(pipe: Connection, backend: Backend, specs: list[tuple[LayoutSpec, int]]) -> None:
    """Hosts one sender per (layout, seed); commands: ("send", index, target, src, layers_per_call, pause)."""
    senders = []
    for layout_spec, seed in specs:
        layout = make_layout(**layout_spec)
        senders.append(KvSender(make_pool(layout, seed), layout, make_config(backend)))
    pipe.send(("ok", None))
    try:
        while (command := pipe.recv())[0] != "quit":
            _, index, target, src, layers_per_call, pause_after = command
            try:
                transfer = senders[index].open_transfer(target)
                for first in range(target.layer_start, target.layer_end, layers_per_call):
                    if first == pause_after:
                        pipe.send(("paused", first))
                        pipe.recv()  # wait to be told to go on (or to be killed)
                    transfer.send_layers(src, range(first, min(first + layers_per_call, target.layer_end)))
                transfer.finish(120)
                pipe.send(("ok", None))
            except PdRouterError as exc:
                pipe.send(("error", type(exc).__name__, exc.message))
    finally:
        for sender in senders:
            sender.close()


def receiver_main(pipe: Connection, backend: Backend, layout_spec: LayoutSpec) -> None:
    """Hosts one receiver; commands: ("expect", id, dst) answers the target, ("wait_layer", id, layer)."""
    layout = make_layout(**layout_spec)
    receiver = KvReceiver(make_pool(layout, None), layout, make_config(backend))
    handles = {}
    try:
        while (command := pipe.recv())[0] != "quit":
            try:
                if command[0] == "expect":
                    handle = receiver.expect(command[1], command[2], timeout_s=120)
                    handles[command[1]] = handle
                    target: TransferTarget = handle.target
                    pipe.send(("ok", target))
                elif command[0] == "wait_layer":
                    handles[command[1]].wait_layer(command[2], 60)
                    pipe.send(("ok", None))
            except PdRouterError as exc:
                pipe.send(("error", type(exc).__name__, exc.message))
    finally:
        receiver.close()
