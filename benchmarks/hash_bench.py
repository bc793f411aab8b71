"""Time to hash a 32k-token prompt into chained 16-token block hashes (target: <= 2 ms).

    python benchmarks/hash_bench.py [--quick] [--json]
"""

from __future__ import annotations

import random
import time

from _report import Report, base_parser

from pdrouter.core.hashing import BlockHasher

TARGET_MS = 2.0


def main() -> None:
    args = base_parser(__doc__ or "").parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(128_256) for _ in range(32_768)]
    hasher = BlockHasher(block_size=16, seed=0)
    repeats = 50 if args.quick else 300
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        hashes = hasher.hash_blocks(tokens)
        times.append(time.perf_counter() - start)
    assert len(hashes) == 2048
    times.sort()
    report = Report()
    report.add("hash_32k_tokens_p50", times[len(times) // 2] * 1e3, "ms")
    report.add("hash_32k_tokens_min", times[0] * 1e3, "ms")
    report.add("hash_per_block_p50", times[len(times) // 2] / 2048 * 1e9, "ns")
    report.add("hash_target", TARGET_MS, "ms")
    report.add("hash_target_met", int(times[len(times) // 2] * 1e3 <= TARGET_MS), "bool")
    report.emit(args.json)


if __name__ == "__main__":
    main()
