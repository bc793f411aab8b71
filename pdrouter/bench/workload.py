"""What a load test sends: request lengths, prompts as token ids, and the workloads built from them.

Prompts are token ids (sent as the OpenAI ``prompt`` array), so a request's input length is exact on
any server, with no tokenizer in the loop. Random ids are drawn from ``token_range`` (``lo``
inclusive, ``hi`` exclusive), by default 32–126: the printable ASCII bytes of the byte-level
tokenizer, valid ids (one token each) in every vocabulary of this project's models and of the usual
HF ones, and readable when a server logs the decoded prompt.

Every builder is deterministic: the same arguments (``seed`` and ``point`` included) give the same
list. A request's ``index`` is its position in the returned list.

**Fresh requests per point.** A command that runs several points (a sweep's rates, a search's steps,
a comparison's layouts) builds each point's requests with its own ``point`` number, so that no point
resends a prompt another one sent: a server's prefix cache would serve it, and the later points'
TTFT would measure the cache instead of the load. The first tokens after a request's shared prefix
(its first tokens when it has none) spell the point and the request's index in the base of the token
range (:func:`nonce`), so two requests of one seed never share a prompt, nor even a first uncached
block. Only a prefix a workload declares (``shared-prefix`` and ``rag``: its system prompts, the same in
every point) is meant to be served from the cache; ``RequestSpec.shared_prefix_len`` says how much,
and :func:`expected_hit_rate` turns it into the prefix hit rate a point can reach at most.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdrouter.core.errors import ConfigError

DEFAULT_TOKEN_RANGE = (32, 127)
"""Printable ASCII (32–126) of the byte-level tokenizer; ``hi`` is exclusive."""

_KINDS = ("fixed", "uniform", "lognormal")
_FIXED = re.compile(r"[+-]?[0-9]+")
_UNIFORM = re.compile(r"([+-]?[0-9]+)\s*-\s*([+-]?[0-9]+)")


def _check_dist(kind: str, a: float, b: float, cap: int | None, what: str, text: str) -> None:
    """Raise ConfigError (naming ``what``) unless the parameters make a distribution of lengths >= 1."""
    shown = text or f"{kind} {a} {b}"
    if kind not in _KINDS:
        raise ConfigError(f"{what}: unknown length distribution {kind!r} (choose from {', '.join(_KINDS)})")
    if not (math.isfinite(a) and math.isfinite(b)):
        raise ConfigError(f"{what}: lengths must be finite numbers, got {shown!r}")
    if kind == "fixed" and a < 1:
        raise ConfigError(f"{what}: a length must be >= 1 token, got {shown!r}")
    if kind == "uniform":
        if a < 1 or b < 1:
            raise ConfigError(f"{what}: lengths must be >= 1 token, got {shown!r}")
        if a > b:
            raise ConfigError(f"{what}: LO must not exceed HI, got {shown!r}")
    if kind == "lognormal":
        if a <= 0:
            raise ConfigError(f"{what}: the lognormal mean must be > 0 tokens, got {shown!r}")
        if b < 0:
            raise ConfigError(f"{what}: the lognormal sigma must be >= 0, got {shown!r}")
    if cap is not None and cap < 1:
        raise ConfigError(f"{what}: the maximum length must be >= 1 token, got {shown!r}")


def _int(text: str, what: str, whole: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{what}: expected a whole number of tokens, got {whole!r}") from None


def _float(text: str, what: str, whole: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{what}: expected a number, got {whole!r}") from None


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A distribution of lengths in tokens: ``fixed N`` | ``uniform LO-HI`` (both inclusive) |
    ``lognormal MEAN:SIGMA`` (``a`` the mean of the distribution in tokens, ``b`` the sigma of the
    underlying normal). Samples are rounded and clipped to ``[1, cap]`` (``cap`` None: no upper bound).
    """

    kind: str
    a: float
    b: float = 0.0
    cap: int | None = None

    def __post_init__(self) -> None:
        _check_dist(self.kind, self.a, self.b, self.cap, "length distribution", "")

    @classmethod
    def parse(cls, text: str, what: str) -> LengthDist:
        """``"512"`` | ``"100-1000"`` | ``"lognormal:1000:0.5"`` (optionally ``":MAX"`` after the sigma).

        ConfigError naming ``what`` (the flag, e.g. ``--input-len``) on anything else, a length
        below 1, LO > HI, a non-positive mean or a negative sigma.
        """
        s = text.strip()
        if s.startswith("lognormal:"):
            parts = s.split(":")[1:]
            if len(parts) not in (2, 3):
                raise ConfigError(f"{what}: expected lognormal:MEAN:SIGMA[:MAX], got {text!r}")
            mean, sigma = _float(parts[0], what, text), _float(parts[1], what, text)
            cap = _int(parts[2], what, text) if len(parts) == 3 else None
            _check_dist("lognormal", mean, sigma, cap, what, text)
            return cls("lognormal", mean, sigma, cap)
        uniform = _UNIFORM.fullmatch(s)
        if uniform:
            lo, hi = int(uniform[1]), int(uniform[2])
            _check_dist("uniform", lo, hi, None, what, text)
            return cls("uniform", lo, hi)
        if not _FIXED.fullmatch(s):
            raise ConfigError(f"{what}: expected N, LO-HI or lognormal:MEAN:SIGMA, got {text!r}")
        n = int(s)
        _check_dist("fixed", n, 0.0, None, what, text)
        return cls("fixed", n)

    def sample(self, rng: random.Random) -> int:
        """One length, >= 1 (and <= ``cap`` when set). A fixed length draws nothing from ``rng``."""
        if self.kind == "fixed":
            n = round(self.a)
        elif self.kind == "uniform":
            n = rng.randint(round(self.a), round(self.b))
        else:
            mu = math.log(self.a) - self.b * self.b / 2  # so that E[X] = a
            n = round(rng.lognormvariate(mu, self.b))
        n = max(1, n)
        return min(n, self.cap) if self.cap is not None else n

    @property
    def mean(self) -> float:
        """The distribution's nominal mean in tokens (before rounding and clipping)."""
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return self.a

    def __str__(self) -> str:
        """The text :meth:`parse` reads back."""
        if self.kind == "fixed":
            return f"{round(self.a)}"
        if self.kind == "uniform":
            return f"{round(self.a)}-{round(self.b)}"
        return f"lognormal:{self.a:g}:{self.b:g}" + (f":{self.cap}" if self.cap is not None else "")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload: its prompt as token ids and how many tokens to generate."""

    index: int
    prompt: tuple[int, ...]
    """Token ids, sent as the OpenAI ``prompt`` array."""
    max_tokens: int
    arrival_s: float | None = None
    """Trace replay: seconds after the start (None: the arrival process decides)."""
    prefix_group: int | None = None
    """Shared-prefix workload: which system prompt this request starts with."""
    shared_prefix_len: int = 0
    """Tokens at the start of the prompt that the workload shares with other requests on purpose (a
    system prompt): the only part a prefix cache may serve."""

    @property
    def input_tokens(self) -> int:
        """The prompt's length in tokens."""
        return len(self.prompt)

    @property
    def digest(self) -> str:
        """BLAKE2b (8 bytes, hex) of the prompt's ids: equal prompts, equal digests."""
        return hashlib.blake2b(array("I", self.prompt).tobytes(), digest_size=8).hexdigest()


def _check_common(n: int, token_range: tuple[int, int]) -> None:
    if n < 0:
        raise ConfigError(f"--num-requests must be >= 0, got {n}")
    lo, hi = token_range
    if not 0 <= lo < hi:
        raise ConfigError(f"token range must satisfy 0 <= lo < hi, got {token_range}")


def _ids(rng: random.Random, length: int, token_range: tuple[int, int]) -> tuple[int, ...]:
    return tuple(rng.choices(range(*token_range), k=length))


MAX_POINTS = 1 << 12
"""Points one command may number (``point`` in ``0 .. MAX_POINTS - 1``)."""
MAX_POINT_REQUESTS = 1 << 20
"""Requests one point may hold."""


def nonce(point: int, index: int, token_range: tuple[int, int]) -> tuple[int, ...]:
    """The serial ``point · 2^20 + index`` spelt in base ``hi - lo`` with ids of ``token_range``,
    most significant digit first, as many digits as the largest serial needs (5 over printable ASCII):
    distinct for every (point, index), so prompts that start with it differ in their first block."""
    if not 0 <= point < MAX_POINTS:
        raise ConfigError(f"a command runs at most {MAX_POINTS} points, got point {point}")
    if not 0 <= index < MAX_POINT_REQUESTS:
        raise ConfigError(f"a point holds at most {MAX_POINT_REQUESTS} requests, got index {index}")
    lo, hi = token_range
    base = hi - lo
    digits = 1
    while base ** digits < MAX_POINTS * MAX_POINT_REQUESTS:
        digits += 1
    serial = point * MAX_POINT_REQUESTS + index
    out = []
    for _ in range(digits):
        serial, digit = divmod(serial, base)
        out.append(lo + digit)
    return tuple(reversed(out))


def _point_rng(seed: int, point: int, what: str) -> random.Random:
    """A generator of its own for each (seed, point, purpose): str seeds are hashed (SHA-512) by
    ``random``, the same on every run and platform."""
    return random.Random(f"pdrouter-bench:{seed}:{point}:{what}")


def _fresh(rng: random.Random, length: int, point: int, index: int, token_range: tuple[int, int]) -> tuple[int, ...]:
    """``length`` ids: the request's nonce (cut to ``length``), then random ids."""
    head = nonce(point, index, token_range)[:length]
    return head + _ids(rng, length - len(head), token_range)


def synthetic(n: int, input_len: LengthDist, output_len: LengthDist, *, seed: int, point: int = 0,
              token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> list[RequestSpec]:
    """``n`` requests of random token ids in ``token_range`` (default: printable ASCII of the byte-level
    tokenizer, so each id is one valid token for any tokenizer of ours), lengths drawn from the two
    distributions. Each prompt starts with its :func:`nonce` (``point``, index): no two share a block."""
    _check_common(n, token_range)
    rng = _point_rng(seed, point, "requests")
    specs = []
    for i in range(n):
        length = input_len.sample(rng)
        max_tokens = output_len.sample(rng)
        specs.append(RequestSpec(i, _fresh(rng, length, point, i, token_range), max_tokens))
    return specs


def shared_prefix(n: int, *, prefixes: int, prefix_len: int, suffix_len: LengthDist, output_len: LengthDist,
                  seed: int, point: int = 0, token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> list[RequestSpec]:
    """The traffic of prefix caching (RAG, agents): ``prefixes`` distinct system prompts of
    ``prefix_len`` tokens each, drawn from ``seed`` alone (the same at every ``point``); request ``i``
    uses prefix ``i % prefixes`` (round-robin, so groups are equal in size to within one and
    interleaved) followed by its own suffix, which starts with its :func:`nonce`."""
    _check_common(n, token_range)
    if prefixes < 1:
        raise ConfigError(f"--prefixes must be >= 1, got {prefixes}")
    if prefix_len < 1:
        raise ConfigError(f"--prefix-len must be >= 1 token, got {prefix_len}")
    width = token_range[1] - token_range[0]
    if width ** min(prefix_len, 64) < prefixes:  # exact; 2**64 exceeds any count of prefixes
        raise ConfigError(f"--prefixes: {prefixes} distinct prefixes of {prefix_len} tokens "
                          f"do not exist over {width} token ids")
    head_rng = _point_rng(seed, 0, "prefixes")
    heads: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    while len(heads) < prefixes:
        head = _ids(head_rng, prefix_len, token_range)
        if head not in seen:  # distinct groups must not share a cache entry
            seen.add(head)
            heads.append(head)
    rng = _point_rng(seed, point, "requests")
    specs = []
    for i in range(n):
        group = i % prefixes
        length = suffix_len.sample(rng)
        max_tokens = output_len.sample(rng)
        specs.append(RequestSpec(i, heads[group] + _fresh(rng, length, point, i, token_range), max_tokens,
                                 prefix_group=group, shared_prefix_len=prefix_len))
    return specs


def expected_hit_rate(specs: Sequence[RequestSpec]) -> float:
    """The prefix hit rate a server can reach at most on ``specs``: the declared shared prefixes'
    tokens ÷ every prompt token (0 for a workload that shares nothing). A cache serves whole blocks
    and misses each prefix the first time a worker sees it, so a measured rate sits at or below it;
    a higher one means prompts were served from a cache they should not have been in."""
    total = sum(s.input_tokens for s in specs)
    return sum(min(s.shared_prefix_len, s.input_tokens) for s in specs) / total if total else 0.0


def _line_int(obj: dict[str, object], key: str, where: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{where}: {key} must be an integer, got {value!r}")
    if value < 1:
        raise ConfigError(f"{where}: {key} must be >= 1, got {value}")
    return value


def _line_ids(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: prompt_token_ids must be a non-empty list of token ids")
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"{where}: prompt_token_ids must hold non-negative integers, got {v!r}")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One line of a JSONL trace: its own token ids, or a length to fill with fresh random ids."""

    prompt: tuple[int, ...] | None
    input_len: int
    output_len: int
    arrival_s: float | None


def read_trace(path: Path, *, default_output: int = 128) -> list[TraceRow]:
    """A trace: one JSON object per line, blank lines ignored, other keys ignored.

    * ``prompt_token_ids`` (list of ints) or ``input_len`` (int: that many random ids, drawn when a
      point is built); both may be given when they agree;
    * ``output_len`` (int, optional: ``default_output``);
    * ``timestamp`` (seconds, optional, relative or absolute): on every line or on none. Arrivals are
      normalised so the earliest is 0, and the rows are **sorted by timestamp** (a stable sort:
      ties keep the file's order).

    ConfigError naming the file and the line for bad JSON, a line that is not an object, neither
    ``prompt_token_ids`` nor ``input_len``, non-positive lengths, non-integer ids, a bad or missing
    timestamp; naming the file for an unreadable or empty one.
    """
    if default_output < 1:
        raise ConfigError(f"--output-len must be >= 1, got {default_output}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the workload file: {e}") from None
    rows: list[TraceRow] = []
    first_line: dict[bool, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: bad JSON: {e.msg}") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        input_len = _line_int(obj, "input_len", where)
        prompt: tuple[int, ...] | None = None
        if "prompt_token_ids" in obj:
            prompt = _line_ids(obj["prompt_token_ids"], where)
            if input_len is not None and input_len != len(prompt):
                raise ConfigError(f"{where}: input_len {input_len} disagrees with the "
                                  f"{len(prompt)} prompt_token_ids")
            input_len = len(prompt)
        elif input_len is None:
            raise ConfigError(f"{where}: give prompt_token_ids (a list of ids) or input_len (a length)")
        output = _line_int(obj, "output_len", where) or default_output
        stamp = obj.get("timestamp")
        if stamp is not None and (isinstance(stamp, bool) or not isinstance(stamp, int | float)
                                  or not math.isfinite(stamp)):
            raise ConfigError(f"{where}: timestamp must be a number of seconds, got {stamp!r}")
        first_line.setdefault(stamp is not None, lineno)
        if len(first_line) == 2:
            raise ConfigError(f"{where}: timestamp on some lines and not others "
                              f"(lines {first_line[True]} and {first_line[False]})")
        rows.append(TraceRow(prompt, input_len, output, None if stamp is None else float(stamp)))
    if not rows:
        raise ConfigError(f"{path}: the workload file holds no requests")
    if rows[0].arrival_s is not None:
        rows.sort(key=lambda row: row.arrival_s or 0.0)
    return rows


def from_trace(rows: Sequence[TraceRow], *, seed: int, point: int = 0,
               token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> list[RequestSpec]:
    """The requests of ``rows``: their own ids, or fresh ones (a :func:`nonce` first) for the rows that
    give a length; arrivals shifted so that the first row's is 0."""
    _check_common(0, token_range)
    rng = _point_rng(seed, point, "trace")
    zero = rows[0].arrival_s if rows and rows[0].arrival_s is not None else 0.0
    return [RequestSpec(i, row.prompt if row.prompt is not None else _fresh(rng, row.input_len, point, i, token_range),
                        row.output_len, arrival_s=None if row.arrival_s is None else row.arrival_s - zero)
            for i, row in enumerate(rows)]


def from_jsonl(path: Path, *, seed: int, point: int = 0, token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE,
               default_output: int = 128) -> list[RequestSpec]:
    """:func:`read_trace` then :func:`from_trace`: ``index`` is the position in timestamp order."""
    _check_common(0, token_range)
    return from_trace(read_trace(path, default_output=default_output), seed=seed, point=point,
                      token_range=token_range)


PRESETS: dict[str, tuple[LengthDist, LengthDist]] = {
    "chat": (LengthDist("lognormal", 1000, 0.5), LengthDist("lognormal", 300, 0.5)),
    # 7,936 + 200 tokens fit an 8k context (Llama-3's 8,192) with room to spare.
    "summarize": (LengthDist("fixed", 7936), LengthDist("fixed", 200)),
    "generate": (LengthDist("fixed", 200), LengthDist("fixed", 2000)),
    "rag": (LengthDist("lognormal", 200, 0.5), LengthDist("fixed", 200)),
}
"""(input length, output length) per workload preset; for ``rag`` the input is the suffix that follows
a shared prefix (:func:`shared_prefix` with :data:`RAG_PREFIXES` and :data:`RAG_PREFIX_LEN`)."""

RAG_PREFIXES = 8
"""System prompts of the ``rag`` preset."""
RAG_PREFIX_LEN = 2000
"""Tokens of each ``rag`` system prompt."""


def preset(name: str) -> tuple[LengthDist, LengthDist]:
    """The (input, output) length distributions of a preset: ``chat`` (lognormal ~1000 in / ~300 out),
    ``summarize`` (7,936 in / 200 out, inside an 8k context: long input, short output), ``generate`` (200 in / 2000 out:
    short input, long output), ``rag`` (suffix ~200 / 200 out, after a shared prefix)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"--workload: unknown preset {name!r} (choose from {', '.join(PRESETS)})") from None


@dataclass(frozen=True)
class Workload:
    """A workload as a recipe: every point of a command builds its own requests from it (:meth:`build`).

    ``name`` is one of ``synthetic``, ``shared-prefix``, ``rag``, ``chat``, ``summarize``,
    ``generate``, ``jsonl``; ``input_len`` is the prompt's length, or the suffix's after a shared prefix
    (``prefixes`` × ``prefix_len``); ``trace`` holds a ``jsonl`` workload's rows."""

    name: str
    label: str
    input_len: LengthDist
    output_len: LengthDist
    seed: int = 0
    prefixes: int = 0
    prefix_len: int = 0
    trace: tuple[TraceRow, ...] = ()
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE

    @property
    def replays_prompts(self) -> bool:
        """A trace that brings its own token ids: its prompts cannot be drawn afresh, so each point
        takes rows no other point took."""
        return any(row.prompt is not None for row in self.trace)

    def build(self, n: int, point: int, first_row: int = 0) -> list[RequestSpec]:
        """Point ``point``'s ``n`` requests (a trace: its rows from ``first_row``, at most ``n``)."""
        if self.name == "jsonl":
            return from_trace(self.trace[first_row:first_row + n], seed=self.seed, point=point,
                              token_range=self.token_range)
        if self.prefixes:
            return shared_prefix(n, prefixes=self.prefixes, prefix_len=self.prefix_len, suffix_len=self.input_len,
                                 output_len=self.output_len, seed=self.seed, point=point,
                                 token_range=self.token_range)
        return synthetic(n, self.input_len, self.output_len, seed=self.seed, point=point,
                         token_range=self.token_range)


_NO_RESEND = ("because no point resends a prompt another one sent (a prefix cache would serve it): give a "
              "longer trace, or fewer or smaller points (--num-requests)")


class PointSource:
    """Numbers the points of one command and builds each one's requests, so that no two points send
    the same prompt: ``take(n)`` gives the next point's number and requests; ``number()`` a number for
    requests built elsewhere (a warm-up). A trace with its own token ids is dealt out row by row:
    a point takes rows no earlier point took, and a ConfigError says so when the trace runs out."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self._next = 0
        self._row = 0

    def number(self) -> int:
        point = self._next
        self._next += 1
        return point

    def rows_needed(self, sizes: Sequence[int]) -> int:
        """Rows of a trace with its own ids that points of these sizes would take (0 otherwise)."""
        return sum(sizes) if self.workload.replays_prompts else 0

    def check(self, sizes: Sequence[int]) -> None:
        """ConfigError, before anything runs, when points of ``sizes`` would run out of trace rows."""
        need = self.rows_needed(sizes)
        if need > len(self.workload.trace):
            raise ConfigError(f"--dataset holds {len(self.workload.trace)} requests with their own "
                              f"prompt_token_ids; {len(sizes)} points need {need}, {_NO_RESEND}")

    def take(self, n: int) -> tuple[int, list[RequestSpec]]:
        point = self.number()
        if not self.workload.replays_prompts:
            return point, self.workload.build(n, point)
        if self._row + n > len(self.workload.trace):
            raise ConfigError(f"--dataset holds {len(self.workload.trace)} requests with their own "
                              f"prompt_token_ids and earlier points sent {self._row}; the next needs {n}, "
                              f"{_NO_RESEND}")
        specs = self.workload.build(n, point, self._row)
        self._row += n
        return point, specs
