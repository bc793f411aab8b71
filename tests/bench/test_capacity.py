"""A run's throughput against what the cluster can do, on fresh simulated clusters (``pdrouter up``).

* Offered three times what a 1P1D layout can serve, a run reports the layout's capacity: its decode
  worker's KV pool holds 8 requests at once, so it serves 8 ÷ (one request's decode time) requests/s
  by the timing model, whatever the offered rate. The measured window reads that figure, not the
  drain after the last arrival.
* A fresh cluster exports no KV-bytes counter until its first transfer: the run still counts every
  byte moved (the counter's absence is 0).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdrouter.bench.compare import Layout, bring_up
from pdrouter.core.capacity import blocks_for_tokens, kv_bytes_per_token
from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.model_spec import get_model_preset
from pdrouter.engine.model_folder import write_config_folder
from pdrouter.engine.sim.timing import TimingModel

MODEL = "llama-3-8b"
PROMPT, OUTPUT, SLOTS = 16, 128, 8
SCALE = 4.0


def up(tmp_path: Path, num_blocks: int) -> Iterator[str]:
    folder = write_config_folder(get_model_preset(MODEL), tmp_path / "model" / MODEL)
    with bring_up(Layout("1p1d", prefill=1, decode=1), folder, gpu="h100", time_scale=SCALE,
                  extra=["--num-blocks", str(num_blocks)]) as cluster:
        yield cluster.url


@pytest.fixture
def eight_slots(tmp_path: Path) -> Iterator[str]:
    """A 1P1D cluster whose KV pools hold exactly ``SLOTS`` requests of ``PROMPT + OUTPUT`` tokens."""
    yield from up(tmp_path, SLOTS * blocks_for_tokens(PROMPT + OUTPUT))


@pytest.fixture
def fresh(tmp_path: Path) -> Iterator[str]:
    yield from up(tmp_path, 4096)


def run(url: str, out: Path, *args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "pdrouter", "bench", "run", "--no-progress", "--url", url,
                           "--time-scale", str(SCALE), "--out", str(out), "--json", *args],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(Path(json.loads(done.stdout)["file"]).read_text()))


def test_offered_far_above_capacity_a_run_reports_the_layouts_capacity(eight_slots: str, tmp_path: Path) -> None:
    timing = TimingModel(get_model_preset(MODEL), get_gpu_preset("h100"))
    # Each request holds a slot for one step per output token (its short prompt rides in a step).
    capacity = SLOTS / (OUTPUT * timing.decode_step(SLOTS, PROMPT + OUTPUT // 2).seconds)
    offered = 3 * capacity
    doc = run(eight_slots, tmp_path, "--rate", f"{offered:.3f}", "--num-requests", str(round(offered * 12)),
              "--input-len", str(PROMPT), "--output-len", str(OUTPUT), "--seed", "41")
    steady = doc["steady"]
    assert steady["window"]["steady"], steady["window"]
    assert steady["saturated"]
    assert steady["summary"]["request_rate"] == pytest.approx(capacity, rel=0.10)
    assert steady["offered_rate"] == pytest.approx(offered, rel=0.2)
    assert doc["router"]["sim_late_share"] < 0.05  # the simulated clocks held: the figure is the model's


def test_a_fresh_cluster_counts_the_bytes_of_its_first_transfers(fresh: str, tmp_path: Path) -> None:
    doc = run(fresh, tmp_path, "--concurrency", "1", "--num-requests", "6", "--input-len", "256", "--output-len",
              "2", "--seed", "42")
    assert doc["router"]["kv_transfer_bytes"] == 6 * 256 * kv_bytes_per_token(get_model_preset(MODEL))
