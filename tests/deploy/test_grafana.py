"""deploy/grafana/pd-router.json: a Grafana dashboard whose every query names metrics a router exports.

The names come from a real router (the process's parts in this test's event loop, on a real Redis,
with a tenants file): every ``# TYPE`` line of its ``/metrics``, with the series names each type
adds (``_bucket`` / ``_sum`` / ``_count`` for histograms). A query naming anything else (a typo, a
metric renamed or removed) fails here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from pdrouter.core.tenants import parse_tenants
from pdrouter.engine.model_io import make_model
from pdrouter.router.config import RouterConfig
from pdrouter.router.server import RouterProcess

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pd-router.json"
_METRIC = re.compile(r"\b(pdrouter_[a-z0-9_]+)\b")
_TYPE = re.compile(r"^# TYPE (\S+) (\S+)$", re.M)


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _queries(dashboard: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in _panels(dashboard["panels"]) for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            out.append(query["query"])
    return out


async def _exported(tmp_path: Path, redis_url: str) -> set[str]:
    model = make_model("tiny", 0, tmp_path / "tiny")
    config = RouterConfig(model_dir=model, redis_url=redis_url, http_port=0, grpc_port=0,
                          tenants=parse_tenants({"tenants": {"team-a": None}}))
    router = RouterProcess(config)
    await router.start()
    try:
        assert router.state_metrics is not None
        await router.state_metrics.refresh()
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://127.0.0.1:{router.http_port}/metrics")).text
    finally:
        await router.stop(grace=0.5)
    names: set[str] = set()
    for name, kind in _TYPE.findall(text):
        names.add(name)
        if kind == "histogram":
            names.update(f"{name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
    return names


async def test_every_query_names_a_metric_the_router_exports(tmp_path: Path, redis_url: str) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = await _exported(tmp_path, redis_url)
    queries = _queries(dashboard)
    assert len(queries) >= 30
    used = {name for q in queries for name in _METRIC.findall(q)}
    missing = sorted(used - exported)
    assert not missing, f"the dashboard queries metrics no router exports: {missing}"
    # Every family of the router and its workers' heartbeats is on the dashboard, tenants included
    # (new metrics get a panel), but for the counters' creation times.
    shown = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    families = {n for n in exported if not n.endswith(("_bucket", "_sum", "_count", "_created"))}
    assert families - shown == set(), f"metrics without a panel: {sorted(families - shown)}"


def test_the_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = list(_panels(dashboard["panels"]))
    assert dashboard["uid"] == "pd-router" and len({p["id"] for p in panels}) == len(panels)
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "job", "tenant"}
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            for opening, closing in ("()", "{}", "[]"):
                assert expr.count(opening) == expr.count(closing), expr
            assert 'job=~"$job"' in expr, expr  # every query follows the job selector
            if "histogram_quantile" in expr:
                assert "_bucket" in expr and "le" in expr, expr
            if "pdrouter_tenant_" in expr:
                assert 'tenant=~"$tenant"' in expr, expr
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24

