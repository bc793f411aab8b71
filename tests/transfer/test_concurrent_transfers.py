"""Sixteen prefill pools sending to sixteen decode pools at once over TCP: every byte lands where it
should, every transfer ends DONE, and nothing is left on either side (one process, real sockets)."""

from __future__ import annotations

import random
import threading

from pdrouter.core.kv_layout import KvLayout
from pdrouter.transfer import KvReceiver, KvSender, TransferState

from .factories import blocks_equal, make_config, make_layout, make_pool, wait_until

PAIRS = 16


def test_sixteen_senders_to_sixteen_receivers_at_once_are_bit_exact() -> None:
    layout: KvLayout = make_layout("bfloat16", num_layers=8, num_blocks=48)
    srcs = [make_pool(layout, seed) for seed in range(PAIRS)]
    dsts = [make_pool(layout, None) for _ in range(PAIRS)]
    receivers = [KvReceiver(pool, layout, make_config()) for pool in dsts]
    senders = [KvSender(pool, layout, make_config()) for pool in srcs]
    rng = random.Random(7)
    # sender i sends to receivers 5i and 5i + 1 (mod 16): every receiver hears from two senders, and each
    # sender's two transfers share nothing but the machine; blocks are scattered on both sides
    plan = []
    for i in range(PAIRS):
        for k, r in enumerate(((5 * i) % PAIRS, (5 * i + 1) % PAIRS)):
            src = rng.sample(range(layout.num_blocks), 12)
            dst = list(range(k * 24, k * 24 + 12))  # each receiver's two senders write disjoint halves
            rng.shuffle(dst)
            plan.append((i, r, src, dst))
    handles = [receivers[r].expect(f"t-{i}-{r}", dst, timeout_s=60) for i, r, _, dst in plan]
    barrier = threading.Barrier(len(plan))
    errors: list[BaseException] = []

    def send(index: int) -> None:
        i, _, src, _ = plan[index]
        try:
            barrier.wait()
            transfer = senders[i].open_transfer(handles[index].target)
            for layer in range(layout.num_layers):
                transfer.send_layers(src, layer)
            transfer.finish(60)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(n,)) for n in range(len(plan))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        assert not errors, errors[:3]
        for handle in handles:
            handle.wait_all(30)
            assert handle.state is TransferState.DONE
        for (i, r, src, dst) in plan:
            assert blocks_equal(srcs[i], src, dsts[r], dst), f"sender {i} -> receiver {r}"
        assert wait_until(lambda: all((rc.stats().expectations, rc.stats().deadlines) == (0, 0) for rc in receivers))
        assert wait_until(lambda: all((s.stats().transfers, s.stats().queued_messages, s.stats().inflight_bytes)
                                      == (0, 0, 0) for s in senders))
    finally:
        for sender in senders:
            sender.close()
        for receiver in receivers:
            receiver.close()
