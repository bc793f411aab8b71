"""Receives vLLM's KV events over ZMQ, in order, asking for a replay whenever it may have missed some.

vLLM's publisher (``kv_events_config``: ``publisher="zmq"``) sends ``(topic, seq, payload)`` on a
PUB socket, ``seq`` counting batches from 0 (8 bytes, big-endian), and keeps the last
``buffer_steps`` batches for replay on a ROUTER socket: a request naming a first ``seq`` is answered
with every buffered batch from there, then an end marker (seq -1).

:class:`KvEventSubscriber` runs one thread that:

* connects, and asks for a replay from 0 (batches published before it subscribed);
* applies batches strictly in ``seq`` order; on a gap it asks for a replay from the first missing
  one and drops live batches until the replay has filled it; duplicates (a batch received both live
  and replayed) are dropped;
* treats a ``seq`` that goes back with a newer timestamp as a restarted publisher (a vLLM engine that
  restarted: its cache is empty): everything indexed is removed, then its batches apply from 0;
* when the replay no longer holds the missing batches, removes everything indexed and goes on from
  what it has (the index forgets, it never claims a block vLLM does not hold).
"""

from __future__ import annotations

import logging
import threading

from pdrouter.engine.vllm.events import KvEvent, KvEventTranslator, decode_batch

log = logging.getLogger(__name__)

_END_SEQ = -1


class KvEventSubscriber:
    """One vLLM engine's KV events → a :class:`KvEventTranslator` (see the module docstring)."""

    def __init__(self, endpoint: str, replay_endpoint: str, translator: KvEventTranslator, topic: str = "",
                 poll_ms: int = 100) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.translator = translator
        self.topic = topic.encode()
        self.poll_ms = poll_ms
        self._next_seq = 0
        self._last_ts = float("-inf")
        self._replaying = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)
        self.batches = 0
        """Batches applied."""
        self.replays = 0
        """Replays asked for (the first, at connect, included)."""
        self.restarts = 0
        """Restarted publishers seen."""
        self.lost = 0
        """Gaps the replay could not fill (the index was cleared)."""

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        import zmq

        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        replay = ctx.socket(zmq.DEALER)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            sub.connect(self.endpoint)
            replay.connect(self.replay_endpoint)
            poller = zmq.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(replay, zmq.POLLIN)
            self._ask_replay(replay, 0)
            while not self._stop.is_set():
                for sock, _ in poller.poll(self.poll_ms):
                    if sock is sub:
                        self._live(replay, sub.recv_multipart())
                    else:
                        self._replayed(replay.recv_multipart())
        except Exception:  # the index is a hint: losing its feed must not take the worker down
            log.exception("KV event subscriber stopped; the prefix index gets no more updates from vLLM")
        finally:
            sub.close(linger=0)
            replay.close(linger=0)
            ctx.term()

    def _ask_replay(self, replay: object, start: int) -> None:
        self.replays += 1
        self._replaying = True
        replay.send_multipart((b"", start.to_bytes(8, "big")))  # type: ignore[attr-defined]

    def _live(self, replay: object, frames: list[bytes]) -> None:
        if len(frames) != 3:
            log.warning("KV events: a message of %d frames, skipped", len(frames))
            return
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        events, ts = decode_batch(payload)
        if seq < self._next_seq and ts > self._last_ts:
            log.info("KV events: vLLM's publisher restarted (batch %d after %d); its cache starts empty",
                     seq, self._next_seq - 1)
            self.restarts += 1
            self.translator.clear()
            self._next_seq, self._last_ts, self._replaying = 0, float("-inf"), False
        if seq > self._next_seq:
            if not self._replaying:
                log.info("KV events: batches %d..%d missed; asking for a replay", self._next_seq, seq - 1)
                self._ask_replay(replay, self._next_seq)
            return
        if seq == self._next_seq:
            self._apply(seq, events, ts)

    def _replayed(self, frames: list[bytes]) -> None:
        if len(frames) != 4:
            log.warning("KV events: a replay message of %d frames, skipped", len(frames))
            return
        _, _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq == _END_SEQ:
            self._replaying = False
            return
        events, ts = decode_batch(payload)
        if seq > self._next_seq:  # the replay buffer no longer holds what was missed
            log.warning("KV events: batches %d..%d are gone from vLLM's replay buffer; the prefix index "
                        "forgets this worker's blocks and goes on from %d", self._next_seq, seq - 1, seq)
            self.lost += 1
            self.translator.clear()
            self._next_seq = seq
        if seq == self._next_seq:
            self._apply(seq, events, ts)

    def _apply(self, seq: int, events: list[KvEvent], ts: float) -> None:
        self._next_seq = seq + 1
        self._last_ts = max(self._last_ts, ts)
        self.translator.apply(events)
        self.batches += 1
