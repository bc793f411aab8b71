"""Time to hash a 32k-token prompt into chained 16-token block hashes (target: <= 2 ms).

The main figure hashes a prompt the hasher has not seen (every repetition a new one). A hasher
remembers the latest prompts it hashed (``pdrouter.core.hashing``, the memo), so the
``shared_prefix`` figures hash prompts that repeat one prefix with a fresh tail: a 2,000-token
system prompt and a 200-token question (``_2k``), and all but the last 256 tokens of a 32k-token
one (``_32k``), against the same prompts hashed with the memo emptied each time (``..._unseen``).

    python benchmarks/hash_bench.py [--quick] [--json]
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

from _report import Report, base_parser

from pdrouter.core.hashing import BlockHasher
from pdrouter.core.tokens import pack_token_ids

TARGET_MS = 2.0
VOCAB = 128_256


def timed(hash_one: Callable[[int], object], repeats: int) -> list[float]:
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        hash_one(i)
        times.append(time.perf_counter() - start)
    return sorted(times)


def main() -> None:
    args = base_parser(__doc__ or "").parse_args()
    rng = random.Random(0)
    repeats = 50 if args.quick else 300
    unseen = [[rng.randrange(VOCAB) for _ in range(32_768)] for _ in range(8)]
    hasher = BlockHasher(block_size=16, seed=0)

    def first_time(i: int) -> object:  # a prompt the hasher has not seen: its memo emptied first
        hasher._memo.clear()
        return hasher.hash_blocks(unseen[i % 8])

    times = timed(first_time, repeats)
    assert len(hasher.hash_blocks(unseen[0])) == 2048
    report = Report()
    p50 = statistics.median(times)
    report.add("hash_32k_tokens_p50", p50 * 1e3, "ms")
    report.add("hash_32k_tokens_min", times[0] * 1e3, "ms")
    report.add("hash_per_block_p50", p50 / 2048 * 1e9, "ns")
    report.add("hash_target", TARGET_MS, "ms")
    report.add("hash_target_met", int(p50 * 1e3 <= TARGET_MS), "bool")

    for name, prefix_tokens, tail_tokens in (("2k", 2_000, 200), ("32k", 32_512, 256)):
        prefix = [rng.randrange(VOCAB) for _ in range(prefix_tokens)]
        prompts = [pack_token_ids(prefix + [rng.randrange(VOCAB) for _ in range(tail_tokens)])
                   for _ in range(repeats + 1)]
        shared = BlockHasher(block_size=16, seed=0)
        shared.hash_packed(prompts[-1])
        cold = BlockHasher(block_size=16, seed=0)

        def remembering(i: int, h: BlockHasher = shared, p: list[bytes] = prompts) -> object:
            return h.hash_packed(p[i])

        def forgetting(i: int, h: BlockHasher = cold, p: list[bytes] = prompts) -> object:
            h._memo.clear()
            return h.hash_packed(p[i])

        with_memo = timed(remembering, repeats)
        without = timed(forgetting, repeats)
        report.add(f"hash_{name}_shared_prefix_p50", statistics.median(with_memo) * 1e6, "us")
        report.add(f"hash_{name}_shared_prefix_unseen_p50", statistics.median(without) * 1e6, "us")
    report.emit(args.json)


if __name__ == "__main__":
    main()
