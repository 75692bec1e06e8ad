"""``deploy/grafana/kvroute.json``: a dashboard Grafana can import. That every query names
a series a live front door exports is checked against a served fleet, in
``tests/router/api/test_http_serving.py::test_the_grafana_dashboard_queries_only_exported_series``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "kvroute.json"
METRIC = re.compile(r"\bkvroute:[a-zA-Z0-9_:]+")


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def queried_series(dashboard: dict[str, Any]) -> set[str]:
    """Every ``kvroute:`` sample name the panels' and variables' queries use."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return {m for e in exprs for m in METRIC.findall(e)}


def test_the_dashboard_is_well_formed() -> None:
    d = load()
    assert d["uid"] and d["title"] == "kvroute" and d["panels"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    ids, cells = set(), set()
    for p in d["panels"]:
        assert p["id"] not in ids and p["title"] and p["targets"], p
        ids.add(p["id"])
        assert p["datasource"]["uid"] == "${datasource}"
        g = p["gridPos"]  # panels do not overlap on Grafana's 24-column grid
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24
        xs, ys = range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])
        here = {(x, y) for x in xs for y in ys}
        assert not here & cells, p["title"]
        cells |= here
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            assert METRIC.search(t["expr"]), t["expr"]


def test_the_dashboard_covers_what_an_operator_watches() -> None:
    """Fleet hit rate, TTFT/ITL percentiles, requests per replica, index size, streams."""
    series = queried_series(load())
    for needed in (
        "kvroute:prefix_cache_hits_total",
        "kvroute:prefix_cache_queries_total",
        "kvroute:time_to_first_token_seconds_bucket",
        "kvroute:inter_token_latency_seconds_bucket",
        "kvroute:replica_routed_total",
        "kvroute:index_blocks",
        "kvroute:events_gaps_total",
        "kvroute:events_resets_total",
        "kvroute:routing_decisions_total",
    ):
        assert needed in series, needed
