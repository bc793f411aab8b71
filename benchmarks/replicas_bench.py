"""Router replicas on one Redis: throughput at 1, 2 and 4 replicas, over-booking seen, cost per request.

Runs ``_replicas.measure_replicas`` alone (``fleet_scale.py`` runs it too); its docstring lists
the figures.

    python benchmarks/replicas_bench.py [--quick] [--json]
"""

from __future__ import annotations

import asyncio

from _replicas import measure_replicas
from _report import Report, base_parser


def main() -> None:
    args = base_parser(__doc__ or "").parse_args()
    report = Report()
    asyncio.run(measure_replicas(report, quick=args.quick))
    report.emit(args.json)


if __name__ == "__main__":
    main()
