"""``pdrouter bench compare --backend vllm``: colocated against 1P1D on real vLLM engines, the machinery
of the simulated comparison at a small size.

The command brings up each layout itself (``pdrouter up --backend vllm``: two colocated workers, then a
prefill and a decode worker whose KV moves through vLLM's KV connector), so this module starts four
engines of its own, two at a time; one rate, one point of 56 short requests per layout.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

CONNECTOR = importlib.util.find_spec("pdrouter.transfer.vllm") is not None
"""1P1D on vLLM needs the project's vLLM KV connector (``pdrouter prefill|decode --backend vllm``)."""


@pytest.mark.skipif(not CONNECTOR, reason="1P1D on vLLM needs the vLLM KV connector (pdrouter.transfer.vllm)")
def test_compare_runs_colocated_against_1p1d_on_vllm_with_fresh_prompts(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "pdrouter", "bench", "compare", "--backend", "vllm", "--gpus", "2", "--layouts",
            "colocated,1p1d", "--rates", "2", "--point-duration", "28", "--input-len", "64", "--output-len", "16",
            "--no-progress", "--json", "--out", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    report = Path(json.loads(done.stdout)["report"])
    data = json.loads((report.parent / "compare.json").read_text())
    assert data["title"].startswith("vLLM 0.") and "2 CPU workers" in data["title"]
    assert [layout["name"] for layout in data["layouts"]] == ["colocated-2", "1p1d"]
    digests: list[str] = []
    for layout in data["layouts"]:
        [point] = layout["points"]
        assert point["requests"] == 56 and point["window"]["requests"] > 0
        records = json.loads(Path(point["file"]).read_text())["requests"]
        assert len(records) == 56 and all(r["ok"] and r["output_tokens"] == 16 for r in records), layout["name"]
        digests += [r["prompt_digest"] for r in records]
        # fresh prompts: vLLM's own prefix cache served none of them, on either layout
        assert point["prefix"]["measured_hit_rate"] == 0.0 and point["prefix"]["expected_hit_rate"] == 0.0
        moved = point["router"].get("kv_transfer_bytes") or 0
        assert (moved > 0) == (layout["name"] == "1p1d"), (layout["name"], moved)  # only 1P1D moves KV
        assert point["router"].get("sim_late_share") is None  # real engines: no simulated clock
    assert len(set(digests)) == len(digests) == 112
    text = report.read_text()
    assert "| rate | colocated-2 | 1p1d | best | why |" in text and "time scale 1" in text
    assert all((report.parent / name).is_file() for name in ("ttft_p99.png", "slo_met_percent.png", "goodput.png"))
