"""What a load test measured: one record per request, service-level objectives, and the run's summary.

The definitions are ``vllm bench serve``'s:

* **TTFT**: from sending the request to its first non-empty streamed token/text;
* **ITL**: each gap between successive streamed arrivals carrying tokens (one per chunk: a chunk of
  several tokens is one gap);
* **TPOT**: per request, ``(E2E - TTFT) / (output_tokens - 1)``, defined for two or more output
  tokens; aggregated over requests;
* **E2E**: from sending the request to the end of its stream;
* throughputs: completed requests, their input and output tokens, each ÷ the run's duration;
* **goodput**: requests meeting every bound of the SLO ÷ the run's duration.

Latency distributions cover completed (ok) requests only. Times are in seconds throughout; only
:meth:`Summary.lines` shows milliseconds.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from pdrouter.core.errors import ConfigError


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it (filled in while it streams; a failure sets ``error``)."""

    index: int
    start_s: float
    """When it was sent, seconds after the run's start."""
    input_tokens: int
    output_tokens: int = 0
    """As the server's usage says (or the chunks counted, without usage)."""
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    status: int = 0
    """The HTTP status (0: no response: connection error, timeout)."""
    error: str = ""
    """"" when ok; else a short kind: ``http_429``, ``http_500``, ``connect``, ``timeout``, ``protocol``,
    ``cancelled``…"""
    cached_tokens: int | None = None
    """Prompt tokens the server served from its prefix cache, when its usage reports them."""
    detail: str = ""
    """A failure's reason as the server gave it (the error body's message), "" when ok or none."""
    prompt_digest: str = ""
    """A digest of the prompt's token ids (BLAKE2b, 8 bytes, hex): which requests sent the same prompt."""

    @property
    def ok(self) -> bool:
        """Completed: HTTP 200 and no error."""
        return self.status == 200 and not self.error

    @property
    def tpot_s(self) -> float | None:
        """``(e2e - ttft) / (output_tokens - 1)`` when there are two or more output tokens and both
        times are known, else None (``vllm bench serve``'s time per output token)."""
        if self.output_tokens < 2 or self.e2e_s is None or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def error_kind(self) -> str:
        """``error``, or for a failure without one ``http_<status>`` (``no_response`` for status 0);
        "" when ok."""
        if self.ok:
            return ""
        if self.error:
            return self.error
        return f"http_{self.status}" if self.status else "no_response"

    def scaled(self, time_scale: float) -> RequestRecord:
        """A copy with every time (``start_s`` included) divided by ``time_scale``: wall-clock seconds
        to simulated ones when a simulated cluster runs ``time_scale`` times faster. A scale of 1 or 0
        leaves the times as they are."""
        if not (time_scale >= 0 and math.isfinite(time_scale)):
            raise ConfigError(f"time scale must be a finite number >= 0, got {time_scale}")
        if time_scale in (0, 1):
            return replace(self, itl_s=list(self.itl_s))
        k = 1.0 / time_scale
        return replace(self, start_s=self.start_s * k, itl_s=[g * k for g in self.itl_s],
                       ttft_s=None if self.ttft_s is None else self.ttft_s * k,
                       e2e_s=None if self.e2e_s is None else self.e2e_s * k)

    def to_dict(self) -> dict[str, object]:
        """Every field (JSON-ready), plus ``ok`` and ``tpot_s``."""
        out: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["itl_s"] = list(self.itl_s)
        out["ok"] = self.ok
        out["tpot_s"] = self.tpot_s
        return out


_SLO_KEYS = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_s", "e2e": "e2e_s", "e2el": "e2e_s"}


def _seconds(value: str, key: str) -> float:
    """``"500ms"``, ``"0.5s"`` or a bare number of milliseconds, in seconds."""
    text = value.strip().lower()
    per_second = 1000.0
    if text.endswith("ms"):
        text = text[:-2]
    elif text.endswith("s"):
        text, per_second = text[:-1], 1.0
    try:
        number = float(text)
    except ValueError:
        raise ConfigError(f"--slo: {key}: expected a time such as 500ms or 0.5s, got {value.strip()!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise ConfigError(f"--slo: {key}: a bound must be a positive finite time, got {value.strip()!r}")
    return number / per_second


@dataclass(frozen=True)
class Slo:
    """Per-request latency bounds, in seconds (None: no bound). ``itl_s`` bounds the request's largest
    inter-token gap (every ITL of the request must be at or below it)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            bound = getattr(self, f.name)
            if bound is not None and not (math.isfinite(bound) and bound > 0):
                raise ConfigError(f"--slo: {f.name[:-2]}: a bound must be a positive finite time, got {bound}")

    @classmethod
    def parse(cls, text: str) -> Slo:
        """``"ttft=500ms,tpot=50ms"``: any subset of ``ttft``, ``tpot``, ``itl``, ``e2e`` (or ``e2el``),
        each in ``ms`` or ``s`` (a bare number is milliseconds, as ``vllm bench serve --goodput``).
        ConfigError ``--slo: ...`` for an empty text or item, an unknown or repeated key, a bad,
        non-positive or infinite number."""
        if not text.strip():
            raise ConfigError("--slo: empty; expected e.g. ttft=500ms,tpot=50ms")
        bounds: dict[str, float] = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            key = key.strip().lower()
            if not sep or not key or not value.strip():
                raise ConfigError(f"--slo: expected KEY=TIME (e.g. ttft=500ms), got {item.strip()!r}")
            if key not in _SLO_KEYS:
                raise ConfigError(f"--slo: unknown key {key!r} (choose from ttft, tpot, itl, e2e)")
            name = _SLO_KEYS[key]
            if name in bounds:
                raise ConfigError(f"--slo: {key} given twice")
            bounds[name] = _seconds(value, key)
        return cls(**bounds)

    def met(self, r: RequestRecord) -> bool:
        """``r`` completed and every given bound holds. A request with one output token has no TPOT
        and meets a TPOT bound; one with no ITL meets an ITL bound; a missing TTFT or E2E misses."""
        if not r.ok:
            return False
        if self.ttft_s is not None and (r.ttft_s is None or r.ttft_s > self.ttft_s):
            return False
        tpot = r.tpot_s
        if self.tpot_s is not None and tpot is not None and tpot > self.tpot_s:
            return False
        if self.itl_s is not None and r.itl_s and max(r.itl_s) > self.itl_s:
            return False
        return self.e2e_s is None or (r.e2e_s is not None and r.e2e_s <= self.e2e_s)

    def describe(self) -> str:
        """E.g. ``"ttft <= 500 ms, tpot <= 50 ms"`` (``"no bounds"`` for none)."""
        parts = [f"{f.name[:-2]} <= {getattr(self, f.name) * 1e3:g} ms"
                 for f in fields(self) if getattr(self, f.name) is not None]
        return ", ".join(parts) or "no bounds"


def percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0–100) of sorted values by linear interpolation between the closest
    ranks (numpy's default, ``method="linear"``); NaN for no values."""
    if not ordered:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    h = (len(ordered) - 1) * q / 100
    lo = math.floor(h)
    if lo + 1 >= len(ordered):
        return float(ordered[-1])
    return ordered[lo] + (h - lo) * (ordered[lo + 1] - ordered[lo])


@dataclass(frozen=True)
class Percentiles:
    """Mean, median, p90 and p99 of some values (NaN each, count 0, for none)."""

    mean: float
    p50: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        """The figures of ``values`` (any order)."""
        ordered = sorted(values)
        mean = math.fsum(ordered) / len(ordered) if ordered else math.nan
        return cls(mean, percentile(ordered, 50), percentile(ordered, 90), percentile(ordered, 99), len(ordered))


@dataclass(frozen=True)
class Summary:
    """A run's figures (see the module docstring for the definitions); latencies in seconds."""

    duration_s: float
    requests: int
    completed: int
    failed: int
    errors: dict[str, int]
    """Failed requests by kind (:attr:`RequestRecord.error_kind`)."""
    request_rate: float
    input_tokens_per_s: float
    output_tokens_per_s: float
    ttft: Percentiles
    tpot: Percentiles
    itl: Percentiles
    e2e: Percentiles
    goodput: float | None
    """Requests/s meeting the SLO (None without one)."""
    slo_met: int | None
    tokens_per_chunk: float = math.nan
    """Output tokens ÷ streamed chunks of the completed requests: 1 when every chunk carried one token;
    above 1 when the server merged tokens into a chunk (each chunk is one ITL gap, so ITL and TPOT
    then differ)."""

    def to_dict(self) -> dict[str, object]:
        """Every field; the percentiles as nested dicts (NaN where there were no values)."""
        return asdict(self)

    def lines(self) -> list[str]:
        """``name: value unit`` lines, latencies in milliseconds."""
        out = [f"duration: {self.duration_s:.6g} s", f"requests: {self.requests}",
               f"completed: {self.completed}", f"failed: {self.failed}"]
        out += [f"errors_{kind}: {count}" for kind, count in sorted(self.errors.items())]
        out += [f"request_throughput: {self.request_rate:.6g} req/s",
                f"input_token_throughput: {self.input_tokens_per_s:.6g} tok/s",
                f"output_token_throughput: {self.output_tokens_per_s:.6g} tok/s"]
        if self.goodput is not None:
            out += [f"goodput: {self.goodput:.6g} req/s", f"slo_met: {self.slo_met}"]
        out.append(f"tokens_per_chunk: {self.tokens_per_chunk:.4g}")
        for name in ("ttft", "tpot", "itl", "e2e"):
            p: Percentiles = getattr(self, name)
            out += [f"{name}_{stat}: {getattr(p, stat) * 1e3:.6g} ms" for stat in ("mean", "p50", "p90", "p99")]
        return out


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo | None = None) -> Summary:
    """``vllm bench serve``'s definitions: request and token throughputs over completed requests and the
    run's duration; TTFT and E2E over completed requests; TPOT per completed request, then aggregated;
    ITL over all gaps of all completed requests; goodput = requests meeting every SLO bound ÷ duration.
    Rates are NaN for a zero duration."""
    if not duration_s >= 0:
        raise ValueError(f"duration must be >= 0 seconds, got {duration_s}")

    def rate(x: float) -> float:
        return x / duration_s if duration_s > 0 else math.nan

    done = [r for r in records if r.ok]
    slo_met = sum(slo.met(r) for r in records) if slo is not None else None
    return Summary(
        duration_s=duration_s,
        request_rate=rate(len(done)),
        input_tokens_per_s=rate(sum(r.input_tokens for r in done)),
        output_tokens_per_s=rate(sum(r.output_tokens for r in done)),
        goodput=None if slo_met is None else rate(slo_met),
        slo_met=slo_met,
        **counts(records),
        **latencies(done),
    )


def counts(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The count fields of a :class:`Summary`: requests, completed, failed, failures by kind."""
    done = sum(r.ok for r in records)
    errors = Counter(r.error_kind for r in records if not r.ok)
    return {"requests": len(records), "completed": done, "failed": len(records) - done,
            "errors": dict(sorted(errors.items()))}


def latencies(done: Sequence[RequestRecord]) -> dict[str, Any]:
    """The latency fields of a :class:`Summary` over completed records: TTFT, TPOT (per request), ITL
    (every gap), E2E and tokens per chunk."""
    return {"ttft": Percentiles.of([r.ttft_s for r in done if r.ttft_s is not None]),
            "tpot": Percentiles.of([t for r in done if (t := r.tpot_s) is not None]),
            "itl": Percentiles.of([g for r in done for g in r.itl_s]),
            "e2e": Percentiles.of([r.e2e_s for r in done if r.e2e_s is not None]),
            "tokens_per_chunk": tokens_per_chunk(done)}


def tokens_per_chunk(done: Sequence[RequestRecord]) -> float:
    """Output tokens ÷ streamed chunks over ``done`` (completed records; 1.0: one token per chunk;
    NaN: none)."""
    chunks = sum(len(r.itl_s) + 1 for r in done if r.ttft_s is not None)
    tokens = sum(r.output_tokens for r in done if r.ttft_s is not None)
    return tokens / chunks if chunks else math.nan
