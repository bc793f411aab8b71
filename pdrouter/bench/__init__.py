"""``pdrouter bench run | sweep | compare``: load tests of OpenAI-compatible servers (vllm bench serve's metrics).

Pure parts (no I/O beyond reading a workload file):

* :mod:`~pdrouter.bench.workload`: what to send (length distributions, synthetic, shared-prefix and
  JSONL trace workloads, presets);
* :mod:`~pdrouter.bench.arrivals`: when to send it (Poisson and gamma arrivals, a KS test of gaps);
* :mod:`~pdrouter.bench.stats`: what was measured (per-request records, SLOs, percentiles, the summary).

At the edge: :mod:`~pdrouter.bench.client` (one timed streamed request), :mod:`~pdrouter.bench.runner`
(one run), :mod:`~pdrouter.bench.scrape` (the router's ``/metrics`` during it) and
:mod:`~pdrouter.bench.report` (what a run leaves behind); :mod:`~pdrouter.bench.point` (one point
of a run, sweep or comparison: sent, written, scored). Comparing layouts:
:mod:`~pdrouter.bench.compare` (layouts on equal simulated GPUs, the winner per rate, crossovers),
:mod:`~pdrouter.bench.compare_run` (each layout up in turn, warmed and swept),
:mod:`~pdrouter.bench.compare_report` and :mod:`~pdrouter.bench.plots` (the report, the PNGs and
their data).
"""
