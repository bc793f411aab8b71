"""The simulated model step: the timing model's seconds, slept on a chained clock, and pseudo-random tokens.

Time: each step costs ``TimingModel.step(batch).seconds`` of simulated time and takes that × the
time scale on the wall clock. Back-to-back steps are chained (a step starts when the previous
one's modeled end passed, not when the Python around it finished), so the code's own per-step
overhead is absorbed while it stays below the modeled step time; when it does not, the simulation
falls behind the wall clock, which ``SimStepStats.behind_s`` and ``late_steps`` show. After the
engine idled, the next step starts at the wall clock's now. Time scale 0 never sleeps.

Tokens: a request's stream is keyed once, at its first sample: greedy requests by their prompt
(the same prompt gives the same tokens, as with a real model), seeded ones by prompt and seed,
others at random. The token at position p is ``low + xxh3_64(key, p) mod (high − low)`` for the
id range ``[low, high)``: the whole vocabulary by default (an eos or stop id then comes up as often
as any other id; ``ignore_eos`` / ``max_tokens`` / ``stop_token_ids`` are honoured by the shared
request logic), or a range whose ids each decode to text (``SimEngineConfig.token_range``: with
the byte-level tokenizer, printable ASCII, so that every token is a streamed text delta).
"""

from __future__ import annotations

import os
import random
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from pdrouter.core.tokens import pack_token_ids
from pdrouter.engine.batch_engine import StepWork
from pdrouter.engine.request import Request
from pdrouter.engine.sim.timing import StepCost, TimingModel

MAX_BEHIND_S = 0.5
"""Wall seconds the chained clock may fall behind before it gives up catching up (restarts at now)."""

_KEY = struct.Struct("<QQ")
_RANDOM = random.Random()
"""Keys of unseeded sampled streams: seeded from the OS once (again in a forked child), not a system
call a request."""
os.register_at_fork(after_in_child=_RANDOM.seed)


@dataclass(frozen=True)
class SimStepStats:
    """What the simulated GPU did so far."""

    steps: int
    busy_s: float
    """Simulated seconds of modeled step time."""
    late_steps: int
    """Steps whose modeled end had already passed on the wall clock when the code got there."""
    behind_s: float
    """How far (wall seconds) the last step ended after its modeled end: the machine is the bottleneck."""
    tokens: int
    """Tokens computed (prefill and decode)."""
    late_s: float = 0.0
    """Simulated seconds by which steps ended after their modeled end, summed: the error the machine's
    own speed added to the modeled time (``late_s / busy_s`` is the share of simulated time lost)."""


def stream_key(request: Request) -> int:
    """The key of a request's token stream (see the module docstring)."""
    if not request.sampling.greedy and request.sampling.seed is None:
        return _RANDOM.getrandbits(64)
    digest = xxhash.xxh3_64(pack_token_ids(request.prompt_token_ids))  # a packed prompt's own bytes
    if request.sampling.seed is not None:
        digest.update(request.sampling.seed.to_bytes(8, "little"))
    return digest.intdigest()


class SimModelStep:
    """A ``ModelStep`` over a ``TimingModel``: no tensors, the modeled time slept (× ``time_scale``)."""

    def __init__(self, timing: TimingModel, token_range: tuple[int, int], time_scale: float = 1.0, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        """``token_range``: the ``[low, high)`` ids tokens are drawn from."""
        self.timing = timing
        self.low, self.high = token_range
        self.time_scale = time_scale
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._chained = False
        self._last_end = 0.0
        self._steps = 0
        self._busy_s = 0.0
        self._late = 0
        self._behind_s = 0.0
        self._late_s = 0.0
        self._tokens = 0
        self.last_cost: StepCost | None = None

    def idle(self) -> None:
        """The engine is about to wait for work: the next step starts at the wall clock's now."""
        self._chained = False

    def run(self, work: Sequence[StepWork]) -> list[int]:
        shapes = [(len(w.token_ids), w.start, w.samples) for w in work]
        cost = self.timing.step_of(shapes)
        tokens = []
        low, span, pack, digest = self.low, self.high - self.low, _KEY.pack, xxhash.xxh3_64_intdigest
        for (n, start, samples), w in zip(shapes, work, strict=True):
            if not samples:
                continue
            req = w.request
            key = req.sampler_state
            if key is None:
                key = req.sampler_state = stream_key(req)
            assert isinstance(key, int)
            tokens.append(low + digest(pack(key, start + n)) % span)  # the token at position start + n
        self._wait(cost.seconds)
        with self._lock:
            self.last_cost = cost
            self._steps += 1
            self._busy_s += cost.seconds
            self._tokens += sum([n for n, _, _ in shapes])
        return tokens

    def kv_finite(self, block_ids: Sequence[int]) -> bool:
        """A simulated pool holds no values: always finite."""
        return True

    def clear_kv(self, block_ids: Sequence[int]) -> None:
        """Nothing to clear in a simulated pool."""

    def _wait(self, seconds: float) -> None:
        if self.time_scale <= 0:
            return
        now = self._clock()
        start = self._last_end if self._chained and now - self._last_end < MAX_BEHIND_S else now
        end = start + seconds * self.time_scale
        remaining = end - now
        if remaining > 0:
            self._sleep(remaining)
            behind = max(0.0, self._clock() - end)
        else:
            behind = -remaining
            with self._lock:
                self._late += 1
                self._late_s += behind / self.time_scale
        with self._lock:
            self._behind_s = behind
        self._last_end = end
        self._chained = True

    def stats(self) -> SimStepStats:
        with self._lock:
            return SimStepStats(self._steps, self._busy_s, self._late, self._behind_s, self._tokens, self._late_s)
