"""Reading a front door's ``/metrics`` in tests, with prometheus-client's own parser."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

# The metrics key of the tests' front doors with API keys (/metrics needs it, or an admin
# key); a front door without keys ignores it.
METRICS_KEY = "key-metrics"


def scrape(url: str, key: str = METRICS_KEY) -> list[Sample]:
    """Every sample ``url`` + ``/metrics`` exposes (the parse fails on malformed text)."""
    r = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {key}"}, timeout=10)
    r.raise_for_status()
    return [s for fam in text_string_to_metric_families(r.text) for s in fam.samples]


def value(samples: list[Sample], name: str, **labels: str) -> float | None:
    """The sum of the samples named ``name`` whose labels include ``labels``; None if none."""
    hits = [
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return sum(hits) if hits else None
