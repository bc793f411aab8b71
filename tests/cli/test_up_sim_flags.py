"""``pdrouter up --backend sim``: ``--link``, ``--utilization`` and ``--quota-gb`` reach the simulated
workers, and the banner says what was brought up (GPU, model, time scale, link, each worker's pool).

The cluster test runs the real ``pdrouter up`` and reads the workers' pools and the KV transfer time
back from the router's ``/metrics``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdrouter.bench.compare import Layout, bring_up
from pdrouter.cli.main import main
from pdrouter.core.capacity import kv_bytes_per_token, plan_capacity
from pdrouter.core.gpu import get_gpu_preset
from pdrouter.core.model_spec import get_model_preset
from pdrouter.engine.model_folder import write_config_folder


def samples(url: str, name: str) -> dict[str, float]:
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    return {s.labels.get("worker", ""): s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name}


def test_the_flags_reach_the_workers_and_the_banner_says_so(tmp_path: Path) -> None:
    folder = write_config_folder(get_model_preset("llama-3-8b"), tmp_path / "model")
    with bring_up(Layout("1p1d", prefill=1, decode=1), folder, gpu="h100", time_scale=1.0,
                  extra=["--link", "tcp-25g", "--quota-gb", "40"]) as cluster:
        (banner,) = [line for line in cluster.banner if line.startswith("sim ")]
        spec, gpu = get_model_preset("llama-3-8b"), get_gpu_preset("h100")
        blocks = plan_capacity(spec, gpu, utilization=None, quota_bytes=40 * 2**30).num_blocks
        gib = blocks * 16 * kv_bytes_per_token(spec) / 2**30
        assert banner == (f"sim        h100-80g, llama-3-8b, time scale 1 (real time), KV link tcp-25g; KV pool per "
                          f"worker {blocks:,} blocks of 16 tokens ({gib:.1f} GiB, utilization 0.5, quota 40 GiB)")
        url = cluster.url
        deadline = time.monotonic() + 30
        while len(samples(url, "pdrouter_kv_capacity_blocks")) < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert set(samples(url, "pdrouter_kv_capacity_blocks").values()) == {float(blocks)}
        # 1,024 prompt tokens of Llama-3-8B are 128 MiB of KV: 43 ms on a 25 Gb/s link, 0.3 ms on NVLink
        body = {"model": "model", "prompt": [65] * 1024, "max_tokens": 2}
        assert httpx.post(f"{url}/completions", json=body, timeout=60).status_code == 200
        moved = samples(url, "pdrouter_kv_transfer_duration_seconds_sum")
        assert sum(moved.values()) >= 1024 * kv_bytes_per_token(spec) / 3.125e9


@pytest.mark.parametrize("cache_aware", [True, False])
def test_no_cache_aware_places_without_prefix_lookups(cache_aware: bool, tmp_path: Path) -> None:
    """``--no-cache-aware`` reaches the router: requests are served, and the prefix index is never read."""
    folder = write_config_folder(get_model_preset("llama-3-8b"), tmp_path / "model")
    extra = [] if cache_aware else ["--no-cache-aware"]
    with bring_up(Layout("colocated-2", colocated=2), folder, gpu="h100", time_scale=0.0, extra=extra) as cluster:
        body = {"model": "model", "prompt": [65] * 256, "max_tokens": 2}
        for _ in range(3):
            assert httpx.post(f"{cluster.url}/completions", json=body, timeout=60).status_code == 200
        lookups = sum(samples(cluster.url, "pdrouter_prefix_lookups_total").values())
    assert (lookups >= 3) if cache_aware else (lookups == 0), lookups


def test_the_routers_limits_reach_it(tmp_path: Path) -> None:
    """``pdrouter up --http-max-inflight 1``: while one request streams, the next is refused with 503 and
    the router's reason (a comparison's own cluster passes the load generator's connection count)."""
    folder = write_config_folder(get_model_preset("llama-3-8b"), tmp_path / "model")
    with bring_up(Layout("colocated-1", colocated=1), folder, gpu="h100", time_scale=1.0,
                  extra=["--http-max-inflight", "1"]) as cluster, httpx.Client(timeout=60) as client:
        body = {"model": "model", "prompt": [65] * 64, "max_tokens": 400, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        with client.stream("POST", f"{cluster.url}/completions", json=body) as first:
            assert first.status_code == 200
            refused = client.post(f"{cluster.url}/completions", json={**body, "stream": False, "stream_options": None})
            assert refused.status_code == 503, refused.text
            assert "limit of 1 requests at once" in refused.json()["error"]["message"]
            # The first stream runs to its end (tokens that came together share an event: count the usage's).
            events = [json.loads(line[6:]) for line in first.iter_lines() if line.startswith("data: {")]
        assert events[-1]["usage"]["completion_tokens"] == 400, events[-1]
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"


@pytest.mark.parametrize(("args", "expected"), [
    (["--backend", "torch", "--link", "nvlink"], "--link only apply to --backend sim"),
    (["--backend", "torch", "--utilization", "0.5", "--quota-gb", "4"], "--utilization, --quota-gb only apply"),
    (["--backend", "sim", "--link", "carrier-pigeon"], "presets: nvlink, rdma-400g"),
    (["--backend", "sim", "--quota-gb", "40", "--utilization", "0.9"], "0.9"),
    (["--backend", "sim", "--quota-gb", "-1"], "--quota-gb must be > 0"),
    (["--backend", "sim", "--http-max-inflight", "0"], "--http-max-inflight must be at least 1, got 0"),
])
def test_bad_sim_flags_are_one_line_errors(args: list[str], expected: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--no-api-key", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and err.count("\n") == 0, err
