"""The front door's own series expose exactly what prometheus-client's types would.

:class:`kvroute.router.api.metrics.Metrics` keeps its counters and histograms as plain numbers
(a token's inter-token latency costs a bisect, not a lock and a Python bucket walk); a
scraper, a dashboard or ``promtool`` must not be able to tell. Each case records the same
observations into prometheus-client's own ``Counter``/``Histogram`` and into ours and
compares the exposition text, ``_created`` timestamps aside.
"""

from __future__ import annotations

import random
import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvroute.router.api.metrics import ITL_BUCKETS, PREFIX, TTFT_BUCKETS, Metrics


def _without_created(text: bytes) -> str:
    return re.sub(r"_created(\{[^}]*\})? \S+", r"_created\1 T", text.decode())


def _reference(ours: Metrics) -> CollectorRegistry:
    """prometheus-client's types with our families' names, docs, labels and buckets."""
    registry = CollectorRegistry(auto_describe=False)
    for fam in ours.families:
        name = fam.name.removeprefix(PREFIX)
        kind = Counter if fam.buckets is None else Histogram
        kw = {} if fam.buckets is None else {"buckets": fam.buckets}
        kind(PREFIX + name, fam.doc, fam.labelnames, registry=registry, **kw)
    return registry


def _family(registry: CollectorRegistry, name: str) -> object:
    return registry._names_to_collectors[name]  # the reference's own collector


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_exposition_equals_prometheus_clients(seed: int) -> None:
    rng = random.Random(seed)
    ours = Metrics()
    ref = _reference(ours)
    values = [0.0, 0.001, 0.0100000001, 80.0, 1e9, *TTFT_BUCKETS, *ITL_BUCKETS]
    for _ in range(500):
        tenant, replica = rng.choice(["a", "b", "other"]), rng.choice(["r0", "r1"])
        v = rng.choice(values) if rng.random() < 0.3 else rng.expovariate(20)
        for fam, labels, amount in (
            (ours.ttft, (tenant, replica), v),
            (ours.itl, (tenant, replica), v),
            (ours.e2e, (tenant, replica), v * 100),
            (ours.added, (), v / 10),
            (ours.http, (tenant, rng.choice(["200", "429"])), 1),
            (ours.prompt_tokens, (tenant,), rng.randrange(1, 4096)),
            (ours.routing, (replica, "cache_hit"), 1),
        ):
            other = _family(ref, fam.name)
            if fam.buckets is None:
                fam.labels(*labels).inc(amount)
                other.labels(*labels).inc(amount)  # type: ignore[attr-defined]
            else:
                (fam.labels(*labels) if labels else fam).observe(amount)
                (other.labels(*labels) if labels else other).observe(amount)  # type: ignore[attr-defined]
    assert _without_created(generate_latest(ours.registry)) == _without_created(
        generate_latest(ref)
    )


def test_a_family_never_observed_exposes_no_samples_as_prometheus_client() -> None:
    ours = Metrics()
    assert _without_created(generate_latest(ours.registry)) == _without_created(
        generate_latest(_reference(ours))
    )


def test_wrong_label_count_is_refused() -> None:
    with pytest.raises(ValueError, match="labels"):
        Metrics().ttft.labels("only-a-tenant")


def test_prefix_hits_are_counted_by_kv_tier() -> None:
    """Device hits are what the cached tokens hold beyond a lower tier's load (issue 38)."""
    from kvroute.events.replica_api import GenerateDelta

    m = Metrics()
    done = GenerateDelta(request_id="a", delta_token_ids=[], finished=True,
                         finish_reason="stop", num_prompt_tokens=100, num_cached_tokens=64,
                         num_output_tokens=2,
                         num_tier_cached_tokens={"CPU": 32, "STORAGE": 16})  # fmt: skip
    plain = GenerateDelta(request_id="b", delta_token_ids=[], finished=True,
                          finish_reason="stop", num_prompt_tokens=50, num_cached_tokens=16,
                          num_output_tokens=2)  # fmt: skip
    m.finished(None, "r0", 0.1, 0.2, done)
    m.finished(None, "r0", 0.1, 0.2, plain)
    text = generate_latest(m.registry).decode()
    got = dict(
        re.findall(r'prefix_cache_hits_by_tier_total\{tenant="[^"]*",tier="(\w+)"\} (\S+)', text)
    )
    assert got == {"GPU": "32.0", "CPU": "32.0", "STORAGE": "16.0"}
