"""``/metrics``: Prometheus series of one front door, with ``prometheus-client``.

Why the names: they follow vLLM's (``vllm:time_to_first_token_seconds``,
``vllm:prefix_cache_hits_total``, ``vllm:num_requests_waiting``, ...) under a ``kvroute:``
prefix, so a dashboard built for vLLM adapts by changing the prefix. The colon is legal in
Prometheus names and is what vLLM uses.

Two kinds of series:
- per request, recorded as requests happen (:class:`Metrics`): latency histograms, token
  and status counters, routing decisions -- labelled by tenant and replica;
- fleet state, read from the front door at scrape time (:class:`FleetCollector`): replica
  health, KV blocks, queue lengths, the index, event-stream health, error counts.

Label cardinality is bounded: replicas are the fleet's (dozens); tenants are the tenants
file's, and past ``MAX_TENANT_LABELS`` distinct ids the rest share the label ``other``.
Every series lives in the front door's own registry (several front doors may share a test
process; none touches the global one).
"""

from __future__ import annotations

import logging
import re
import time
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from itertools import accumulate
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from kvroute.events.load import DISK_NONE, DISK_OFF, DISK_OK

# One line per finished request (INFO): tenant, replica, tokens, TTFT, status. Off unless
# that logger's level lets INFO through (`kvroute serve --log-requests`).
request_log = logging.getLogger("kvroute.requests")

if TYPE_CHECKING:
    from kvroute.events.transport import ReplicaStats

    from ..fleet.fleet import Fleet

PREFIX = "kvroute:"
MAX_TENANT_LABELS = 100
OTHER_TENANT = "other"
MAX_ADAPTER_SERIES = 256  # the holders gauge lists this many adapters at most (by name)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ADDED_LATENCY_WINDOW = 4096  # the latest requests whose added latency /metrics summarizes

# vLLM's buckets for the same histograms (vllm/v1/metrics/loggers.py), cut at 160 s.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)  # fmt: skip
ADDED_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class _HistogramChild:
    """One label set's buckets: a count per bucket (not cumulative) and the sum."""

    __slots__ = ("_bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._bounds, value)] += 1  # the first bound >= value: "le"
        self.sum += value


class _CounterChild:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class _Family:
    """A labelled series kept as plain numbers, exposed only when scraped.

    Why not ``prometheus_client``'s own Counter and Histogram: each ``labels()`` call
    validates and joins its values, and each ``observe``/``inc`` takes a lock and walks the
    buckets in Python, several microseconds a time -- and the front door records every
    streamed token's inter-token latency. Here a child is a dict lookup away and an
    observation is one C bisect and two additions. The exposition (names, labels, buckets,
    ``_created``) is what prometheus-client's own types write. Written and scraped on the
    front door's event loop only, so no lock."""

    def __init__(
        self, name: str, doc: str, labels: list[str], buckets: tuple[float, ...] | None = None
    ) -> None:
        self.name, self.doc, self.labelnames, self.buckets = name, doc, labels, buckets
        self.children: dict[tuple[str, ...], Any] = {}
        if not labels:  # as prometheus-client: a series without labels exists from the start
            self.labels()

    def labels(self, *values: str) -> Any:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: labels {self.labelnames}, got {values}")
            values = tuple(str(v) for v in values)
            made = _CounterChild() if self.buckets is None else _HistogramChild(self.buckets)
            child = self.children.setdefault(values, made)
        return child

    def observe(self, value: float) -> None:  # a family without labels
        self.labels().observe(value)

    def inc(self, amount: float = 1) -> None:
        self.labels().inc(amount)

    def metric(self) -> Metric:
        if self.buckets is None:
            fam: Metric = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
            for values, c in self.children.items():
                fam.add_metric(list(values), c.value, created=c.created)
            return fam
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        les = [floatToGoString(b) for b in self.buckets] + ["+Inf"]
        for values, h in self.children.items():
            cumulative = list(accumulate(h.counts))
            fam.add_metric(list(values), list(zip(les, cumulative, strict=True)), h.sum)
            labels = dict(zip(self.labelnames, values, strict=True))
            fam.samples.append(Sample(self.name + "_created", labels, h.created))
        return fam


class Metrics(Collector):
    """The per-request series of one front door, in its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)  # collect() runs at scrapes only
        self._tenants: set[str] = set()
        self._families: list[_Family] = []  # every series, in the order /metrics lists them

        def hist(name: str, doc: str, labels: list[str], buckets: tuple[float, ...]) -> _Family:
            self._families.append(_Family(PREFIX + name, doc, labels, buckets))
            return self._families[-1]

        def counter(name: str, doc: str, labels: list[str]) -> _Family:
            self._families.append(_Family(PREFIX + name, doc, labels))
            return self._families[-1]

        by = ["tenant", "replica"]
        self.ttft = hist("time_to_first_token_seconds",
                         "Time to first token, as the client sees it (from the request's "
                         "arrival at the front door).", by, TTFT_BUCKETS)  # fmt: skip
        self.itl = hist("inter_token_latency_seconds",
                        "Time between a request's successive output deltas, per token.",
                        by, ITL_BUCKETS)  # fmt: skip
        self.e2e = hist(
            "e2e_request_latency_seconds",
            "From the request's arrival to its last token.",
            by,
            E2E_BUCKETS,
        )
        self.added = hist("router_added_latency_seconds",
                          "Client TTFT minus the replica's own TTFT: what routing, Ray and "
                          "HTTP add (streamed requests).", [], ADDED_BUCKETS)  # fmt: skip
        self.http = counter("http_requests",
                            "API requests answered, by tenant and HTTP status code (a "
                            "stream counts by the status it started with).",
                            ["tenant", "code"])  # fmt: skip
        self.success = counter("request_success",
                               "Requests that ran to their end, by finish reason.",
                               ["tenant", "finished_reason"])  # fmt: skip
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.",
                                     ["tenant"])  # fmt: skip
        self.generation_tokens = counter("generation_tokens", "Tokens generated.", ["tenant"])
        self.cache_queries = counter("prefix_cache_queries",
                                     "Prompt tokens looked up in a replica's prefix cache.",
                                     ["tenant"])  # fmt: skip
        self.cache_hits = counter("prefix_cache_hits",
                                  "Prompt tokens served from a replica's prefix cache.",
                                  ["tenant"])  # fmt: skip
        self.cache_hits_by_tier = counter("prefix_cache_hits_by_tier",
                                          "Prompt tokens served from a replica's prefix "
                                          "cache, by the KV tier they came from (GPU: the "
                                          "device cache; CPU: host memory; STORAGE: disk).",
                                          ["tenant", "tier"])  # fmt: skip
        self.lora_requests = counter("lora_requests",
                                     "Requests routed under each LoRA adapter (the base "
                                     "model's are not counted here).",
                                     ["adapter"])  # fmt: skip
        self.routing = counter("routing_decisions",
                               "Routing decisions by replica and reason: cache_hit (the "
                               "replica holds the longest cached prefix), load (another "
                               "held more, but this one was cheaper), spread (none held "
                               "any: load alone decided), fetch (it pulls the prefix from "
                               "another replica's cache).", ["replica", "reason"])  # fmt: skip
        # The latest streamed requests' added latency, for the recent quantiles' gauge.
        self.added_recent: deque[float] = deque(maxlen=ADDED_LATENCY_WINDOW)
        self.registry.register(self)

    @property
    def families(self) -> tuple[_Family, ...]:
        """The front door's own series (what ``collect`` yields, one per family)."""
        return tuple(self._families)

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            yield family.metric()

    def tenant(self, tenant_id: str | None) -> str:
        """The tenant's label: its id while fewer than MAX_TENANT_LABELS are in use."""
        tid = tenant_id or "none"
        if tid in self._tenants:
            return tid
        if len(self._tenants) < MAX_TENANT_LABELS:
            self._tenants.add(tid)
            return tid
        return OTHER_TENANT

    def count_response(self, scope: Any, status: int) -> None:
        """A response's status, counted per tenant for the API's paths (its head as it
        leaves: the app's for a body, :class:`~.sse.SSEResponse`'s for a stream)."""
        if str(scope.get("path", "")).startswith("/v1/"):
            tenant = self.tenant(scope.get("state", {}).get("tenant"))
            self.http.labels(tenant, str(status)).inc()

    def time_first_delta(self, router_ttft_s: float, replica_ttft_s: float) -> dict[str, float]:
        """One streamed request's TTFT at the front door and at its replica; their
        difference (what routing, the data plane and HTTP added) is recorded."""
        added = router_ttft_s - replica_ttft_s
        self.added_recent.append(added)
        self.added.observe(max(added, 0.0))
        return {
            "replica_ttft_s": round(replica_ttft_s, 6),
            "router_ttft_s": round(router_ttft_s, 6),
        }

    def finished(
        self,
        tenant_id: str | None,
        replica: str,
        ttft_s: float | None,
        e2e_s: float | None,
        last: Any,
    ) -> None:
        """A request that ran to its end (``last``: its final delta)."""
        t = self.tenant(tenant_id)
        if ttft_s is not None:
            self.ttft.labels(t, replica).observe(ttft_s)
        if e2e_s is not None:
            self.e2e.labels(t, replica).observe(e2e_s)
        if last is None:
            return
        self.success.labels(t, last.finish_reason or "unknown").inc()
        self.prompt_tokens.labels(t).inc(last.num_prompt_tokens)
        self.generation_tokens.labels(t).inc(last.num_output_tokens)
        self.cache_queries.labels(t).inc(last.num_prompt_tokens)
        self.cache_hits.labels(t).inc(last.num_cached_tokens)
        lower = getattr(last, "num_tier_cached_tokens", None) or {}
        device = last.num_cached_tokens - sum(lower.values())
        if device > 0:
            self.cache_hits_by_tier.labels(t, "GPU").inc(device)
        for tier, n in lower.items():
            if n > 0:
                self.cache_hits_by_tier.labels(t, tier).inc(n)


def end_request(
    metrics: Metrics,
    rid: str,
    run: Any,
    last: Any,
    ttft_s: float | None,
    status: str,
    arrival: float | None,
) -> None:
    """A request's end: its metrics (when it ran to its end) and its log line."""
    if status.startswith("200") and last is not None and last.finished:
        e2e = None if arrival is None else time.perf_counter() - arrival
        metrics.finished(run.tenant, run.replica, ttft_s, e2e, last)
    if not request_log.isEnabledFor(logging.INFO):
        return
    request_log.info(
        "request %s tenant=%s replica=%s prompt=%s cached=%s output=%s ttft_ms=%s status=%s",
        rid,
        run.tenant,
        run.replica,
        getattr(last, "num_prompt_tokens", None),
        getattr(last, "num_cached_tokens", None),
        getattr(last, "num_output_tokens", None),
        "-" if ttft_s is None else f"{ttft_s * 1000:.1f}",
        status,
    )


class FleetCollector(Collector):
    """Series read from the front door's parts when scraped: nothing to keep in step.

    Why callables for some: the counts they read (every part's errors summed, the
    quarantine's refusals, admission's in-flight count) are computed when scraped, from
    parts this module need not know."""

    def __init__(
        self,
        fleet: Fleet,
        metrics: Metrics,
        counters: Counter[str],
        errors: Callable[[], Mapping[str, int]],
        quarantined: Callable[[], int],
        in_flight: Callable[[], int],
        lora_holders: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        """``counters``: requests, retries, failovers; ``errors``: error counts by kind;
        ``lora_holders``: per LoRA adapter, how many live replicas hold it."""
        self.fleet = fleet
        self.metrics = metrics
        self.counters = counters
        self.errors = errors
        self.quarantined = quarantined
        self.in_flight = in_flight
        self.lora_holders = lora_holders
        self.events: dict[str, ReplicaStats] = {}  # set before each scrape (another thread's)

    def collect(self) -> Iterator[Metric]:
        fleet, c = self.fleet, self.counters
        reps = sorted(fleet.replicas.items())

        def gauge(name: str, doc: str, samples: list[tuple[str, float]]) -> Metric:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["replica"])
            for rid, value in samples:
                g.add_metric([rid], value)
            return g

        def count(name: str, doc: str, value: float) -> Metric:
            return CounterMetricFamily(PREFIX + name, doc, value=value)

        yield count("requests_routed", "Requests routed (retries not counted again).",
                    c["requests"])  # fmt: skip
        yield count("retries", "Requests retried on another replica before their first token.",
                    c["retries"])  # fmt: skip
        yield count("failovers", "Streams continued on another replica mid-stream.",
                    c["failovers"])  # fmt: skip
        yield count("pd_handoffs", "Requests prefilled on a prefill replica and continued on "
                    "a decode replica (P/D).", c["handoffs"])  # fmt: skip
        errors = CounterMetricFamily(PREFIX + "errors", "Errors by kind.", labels=["kind"])
        for kind, n in sorted(self.errors().items()):
            errors.add_metric([kind], n)
        yield errors
        yield GaugeMetricFamily(PREFIX + "quarantined_requests",
                                "Request fingerprints refused as possible queries of death.",
                                value=self.quarantined())  # fmt: skip
        yield GaugeMetricFamily(PREFIX + "num_requests_in_flight",
                                "Requests this front door has admitted and not finished.",
                                value=self.in_flight())  # fmt: skip
        added = sorted(self.metrics.added_recent)
        recent = GaugeMetricFamily(PREFIX + "router_added_latency_recent_seconds",
                                   f"Quantiles of the added latency over the latest "
                                   f"{len(added)} streamed requests.",
                                   labels=["quantile"])  # fmt: skip
        for p in (0.5, 0.9, 0.99):
            if added:
                recent.add_metric([str(p)], added[min(len(added) - 1, int(p * len(added)))])
        yield recent
        yield gauge("replica_up", "1 while the replica is routable.",
                    [(r, float(x.alive)) for r, x in reps])  # fmt: skip
        routed = CounterMetricFamily(PREFIX + "replica_routed", "Requests sent per replica "
                                     "(kept across its restarts).", labels=["replica"])  # fmt: skip
        for r, x in reps:
            routed.add_metric([r], x.routed)
        yield routed
        yield gauge("index_blocks", "Blocks the prefix index holds per replica.",
                    [(r, float(fleet.index.num_blocks(r))) for r, _ in reps])  # fmt: skip
        yield gauge("replica_num_requests_in_flight", "This front door's requests in flight "
                    "per replica.",
                    [(r, float(fleet.load.in_flight_at(r))) for r, _ in reps])  # fmt: skip
        reports = [(r, rep) for r, _ in reps if (rep := fleet.load.last_report(r)) is not None]
        yield gauge("kv_cache_blocks_total", "KV cache blocks per replica.",
                    [(r, float(x.info.num_blocks)) for r, x in reps])  # fmt: skip
        yield gauge("kv_cache_blocks_free", "Free KV blocks per replica (cached blocks no "
                    "request holds count as free), as its latest load report said.",
                    [(r, float(rep.free_blocks)) for r, rep in reports])  # fmt: skip
        yield gauge("kv_cache_usage_perc", "Fraction of the replica's KV blocks in use by "
                    "requests (0-1), as its latest load report said.",
                    [(r, 1.0 - rep.free_blocks / max(rep.total_blocks, 1))
                     for r, rep in reports])  # fmt: skip
        yield gauge("num_requests_waiting", "Requests queued on the replica (every front "
                    "door's), as its latest load report said.",
                    [(r, float(rep.num_waiting)) for r, rep in reports])  # fmt: skip
        yield gauge("num_requests_running", "Requests running on the replica (every front "
                    "door's), as its latest load report said.",
                    [(r, float(rep.num_running)) for r, rep in reports])  # fmt: skip
        if any(rep.lora_slots for _, rep in reports):
            failed = CounterMetricFamily(PREFIX + "lora_read_failures", "LoRA adapter reads "
                                         "that failed on the replica (unreadable, changed "
                                         "since loaded, or past their deadline), since it "
                                         "started.", labels=["replica"])  # fmt: skip
            for r, rep in reports:
                failed.add_metric([r], rep.lora_read_failures)
            yield failed
            yield gauge("lora_reads_hung", "LoRA adapter reads abandoned at their deadline "
                        "whose thread still hangs (a stuck mount), per replica.",
                        [(r, float(rep.lora_reads_hung)) for r, rep in reports])  # fmt: skip
        disks = [(r, rep) for r, rep in reports if rep.kv_disk_state != DISK_NONE]
        if disks:  # replicas with a disk KV tier (docs/kv-tiers.md)
            yield gauge("kv_disk_up", "1 while the replica's disk KV tier serves loads; 0 while "
                        "it is unresponsive (reads stuck) or off (its folder was lost).",
                        [(r, float(rep.kv_disk_state == DISK_OK)) for r, rep in disks])  # fmt: skip
            lost = [(r, float(rep.kv_disk_state == DISK_OFF)) for r, rep in disks]
            yield gauge("kv_disk_folder_lost", "1 once the replica's disk KV folder was deleted "
                        "or replaced: its disk tier is off until it restarts.", lost)  # fmt: skip
            timeouts = CounterMetricFamily(PREFIX + "kv_disk_read_timeouts", "Disk KV reads "
                                           "that did not answer within their deadline (each "
                                           "recomputed), since the replica started.",
                                           labels=["replica"])  # fmt: skip
            for r, rep in disks:
                timeouts.add_metric([r], rep.kv_disk_read_timeouts)
            yield timeouts
        if self.lora_holders is not None:
            held = GaugeMetricFamily(PREFIX + "lora_adapter_replicas", "Live replicas that "
                                     "hold each LoRA adapter (requests naming it are routed "
                                     "only to those; 0: they get a 503).",
                                     labels=["adapter"])  # fmt: skip
            for name, n in sorted(self.lora_holders().items())[:MAX_ADAPTER_SERIES]:
                held.add_metric([name], float(n))
            yield held
        yield from self._event_streams()

    def _event_streams(self) -> Iterator[Metric]:
        fleet, live, retired = self.fleet, self.events, self.fleet.retired_event_stats
        names = sorted(set(live) | set(retired))

        def total(rid: str, field: str) -> float:
            st = live.get(rid)
            extra = 0
            if field == "restarts" and rid in fleet.replicas:
                extra = fleet.replicas[rid].restarts
            return (getattr(st, field) if st else 0) + retired.get(rid, {}).get(field, 0) + extra

        for field, doc in (
            ("delivered", "Event batches applied to the index."),
            ("gaps", "Event seq gaps detected (recovered by replay or snapshot)."),
            ("malformed", "Event messages that could not be decoded (counted and skipped)."),
            ("restarts", "Replica restarts: seen on the event stream, or a new process followed."),
            ("resets", "Times a replica's indexed state was dropped and rebuilt."),
        ):
            fam = CounterMetricFamily(PREFIX + f"events_{field}", doc, labels=["replica"])
            for rid in names:
                fam.add_metric([rid], total(rid, field))
            yield fam
        lag = GaugeMetricFamily(PREFIX + "events_last_seq", "The newest event batch's "
                                "sequence number per replica.", labels=["replica"])  # fmt: skip
        for rid in sorted(live):
            lag.add_metric([rid], float(live[rid].last_seq))
        yield lag


# Every C0 control but the newline (which prometheus-client escapes, and which ends each
# line), and DEL: bytes that no UTF-8 sequence holds but as themselves.
_RAW_CONTROL = re.compile(rb"[\x00-\x09\x0b-\x1f\x7f]")


def _visible(found: re.Match[bytes]) -> bytes:
    return b"\\\\x%02x" % found.group()[0]


def render_metrics(
    metrics: Metrics, fleet: FleetCollector, events: dict[str, ReplicaStats] | None = None
) -> bytes:
    """The exposition text of ``metrics``' registry, ``fleet`` registered in it
    (``events``: the subscriber's stats, taken on the loop).

    Why the pass after prometheus-client: it escapes a label value's backslash, double
    quote and newline, as the text format asks, but writes any other control character
    raw (a NUL in an adapter's name went out as a NUL byte); the format has no escape for
    them. Each is written as the text ``\\xNN`` (a backslash, escaped, then ``xNN``),
    which every parser reads back as those four characters. Names with control characters
    are refused where they are made (:mod:`.names`); this covers any that came another way
    (a ``vllm serve`` backend's adapters)."""
    fleet.events = events or {}
    text = generate_latest(metrics.registry)
    return _RAW_CONTROL.sub(_visible, text) if _RAW_CONTROL.search(text) else text
