"""What a load test sends: request lengths, prompts as token ids, and the workloads built from them.

Prompts are token ids (sent as the OpenAI ``prompt`` array), so a request's input length is exact on
any server, with no tokenizer in the loop. Random ids are drawn from ``token_range`` (``lo``
inclusive, ``hi`` exclusive), by default 32–126: the printable ASCII bytes of the byte-level
tokenizer, valid ids (one token each) in every vocabulary of this project's models and of the usual
HF ones, and readable when a server logs the decoded prompt.

Every builder is deterministic: the same arguments (``seed`` included) give the same list.
A request's ``index`` is its position in the returned list.
"""

from __future__ import annotations

import json
import math
import random
import re
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

    @property
    def input_tokens(self) -> int:
        """The prompt's length in tokens."""
        return len(self.prompt)


def _check_common(n: int, token_range: tuple[int, int]) -> None:
    if n < 0:
        raise ConfigError(f"--num-requests must be >= 0, got {n}")
    lo, hi = token_range
    if not 0 <= lo < hi:
        raise ConfigError(f"token range must satisfy 0 <= lo < hi, got {token_range}")


def _ids(rng: random.Random, length: int, token_range: tuple[int, int]) -> tuple[int, ...]:
    return tuple(rng.choices(range(*token_range), k=length))


def synthetic(n: int, input_len: LengthDist, output_len: LengthDist, *, seed: int,
              token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> list[RequestSpec]:
    """``n`` requests of random token ids in ``token_range`` (default: printable ASCII of the byte-level
    tokenizer, so each id is one valid token for any tokenizer of ours), lengths drawn from the two
    distributions."""
    _check_common(n, token_range)
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        length = input_len.sample(rng)
        max_tokens = output_len.sample(rng)
        specs.append(RequestSpec(i, _ids(rng, length, token_range), max_tokens))
    return specs


def shared_prefix(n: int, *, prefixes: int, prefix_len: int, suffix_len: LengthDist, output_len: LengthDist,
                  seed: int, token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> list[RequestSpec]:
    """The traffic of prefix caching (RAG, agents): ``prefixes`` distinct system prompts of
    ``prefix_len`` tokens each; request ``i`` uses prefix ``i % prefixes`` (round-robin, so groups
    are equal in size to within one and interleaved) followed by its own random suffix."""
    _check_common(n, token_range)
    if prefixes < 1:
        raise ConfigError(f"--prefixes must be >= 1, got {prefixes}")
    if prefix_len < 1:
        raise ConfigError(f"--prefix-len must be >= 1 token, got {prefix_len}")
    width = token_range[1] - token_range[0]
    if width ** min(prefix_len, 64) < prefixes:  # exact; 2**64 exceeds any count of prefixes
        raise ConfigError(f"--prefixes: {prefixes} distinct prefixes of {prefix_len} tokens "
                          f"do not exist over {width} token ids")
    rng = random.Random(seed)
    heads: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    while len(heads) < prefixes:
        head = _ids(rng, prefix_len, token_range)
        if head not in seen:  # distinct groups must not share a cache entry
            seen.add(head)
            heads.append(head)
    specs = []
    for i in range(n):
        group = i % prefixes
        length = suffix_len.sample(rng)
        max_tokens = output_len.sample(rng)
        specs.append(RequestSpec(i, heads[group] + _ids(rng, length, token_range), max_tokens, prefix_group=group))
    return specs


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


def from_jsonl(path: Path, *, seed: int, token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE,
               default_output: int = 128) -> list[RequestSpec]:
    """A trace: one JSON object per line, blank lines ignored, other keys ignored.

    * ``prompt_token_ids`` (list of ints) or ``input_len`` (int: that many random ids in
      ``token_range``, seeded); both may be given when they agree;
    * ``output_len`` (int, optional: ``default_output``);
    * ``timestamp`` (seconds, optional, relative or absolute): on every line or on none. Arrivals are
      normalised so the earliest is 0, and the requests are **sorted by timestamp** (a stable sort:
      ties keep the file's order); ``index`` is then the position in that order.

    ConfigError naming the file and the line for bad JSON, a line that is not an object, neither
    ``prompt_token_ids`` nor ``input_len``, non-positive lengths, non-integer ids, a bad or missing
    timestamp; naming the file for an unreadable or empty one.
    """
    _check_common(0, token_range)
    if default_output < 1:
        raise ConfigError(f"--output-len must be >= 1, got {default_output}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the workload file: {e}") from None
    rng = random.Random(seed)
    rows: list[tuple[tuple[int, ...], int, float | None]] = []
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
        if "prompt_token_ids" in obj:
            prompt = _line_ids(obj["prompt_token_ids"], where)
            if input_len is not None and input_len != len(prompt):
                raise ConfigError(f"{where}: input_len {input_len} disagrees with the "
                                  f"{len(prompt)} prompt_token_ids")
        elif input_len is not None:
            prompt = _ids(rng, input_len, token_range)
        else:
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
        rows.append((prompt, output, None if stamp is None else float(stamp)))
    if not rows:
        raise ConfigError(f"{path}: the workload file holds no requests")
    if rows[0][2] is not None:
        rows.sort(key=lambda row: row[2] or 0.0)
        zero = rows[0][2] or 0.0
        rows = [(p, o, (t or 0.0) - zero) for p, o, t in rows]
    return [RequestSpec(i, p, o, arrival_s=t) for i, (p, o, t) in enumerate(rows)]


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

