"""Prometheus text for ``/metrics``, written by hand: a few series need no client library."""

from __future__ import annotations

from kvroute.events import ReplicaStats

from .frontdoor import FrontDoor


def render_metrics(door: FrontDoor, events: dict[str, ReplicaStats] | None = None) -> str:
    """Prometheus text exposition, by hand (no client library needed for a few series)."""
    c, lines = door.counters, []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP kvroute_{name} {help_}", f"# TYPE kvroute_{name} {kind}"])
        lines.extend(f"kvroute_{name}{labels} {value:g}" for labels, value in samples)

    metric("requests_total", "counter", "Requests routed.", [("", c["requests"])])
    metric("retries_total", "counter", "Requests retried on another replica.",
           [("", c["retries"])])  # fmt: skip
    metric("failovers_total", "counter", "Streams continued on another replica mid-stream.",
           [("", c["failovers"])])  # fmt: skip
    metric("quarantined_requests", "gauge", "Request fingerprints refused as possible "
           "queries of death.", [("", float(door.suspects.refused()))])  # fmt: skip
    metric("prompt_tokens_total", "counter", "Prompt tokens served.", [("", c["prompt_tokens"])])
    metric("completion_tokens_total", "counter", "Tokens generated.",
           [("", c["completion_tokens"])])  # fmt: skip
    metric("cached_tokens_total", "counter", "Prompt tokens served from a prefix cache.",
           [("", c["cached_tokens"])])  # fmt: skip
    metric("errors_total", "counter", "Errors by kind.",
           [(f'{{kind="{k}"}}', v) for k, v in sorted(door.errors.items())])  # fmt: skip
    added = sorted(door.added_latency)
    if added:
        q = [(f'{{quantile="{p}"}}', added[min(len(added) - 1, int(p * len(added)))])
             for p in (0.5, 0.9, 0.99)]  # fmt: skip
        metric("added_latency_seconds", "summary", "Front-door TTFT minus the replica's own "
               f"TTFT, over the latest {len(added)} streamed requests.",
               [*q, ("_sum", c["added_latency_s"]), ("_count", c["timed_streams"])])  # fmt: skip
    reps = sorted(door.replicas.items())
    metric("replica_up", "gauge", "1 while the replica is routable.",
           [(f'{{replica="{r}"}}', float(x.alive)) for r, x in reps])  # fmt: skip
    metric("replica_routed_total", "counter", "Requests served per replica.",
           [(f'{{replica="{r}"}}', x.routed) for r, x in reps])  # fmt: skip
    metric("index_blocks", "gauge", "Blocks the prefix index holds per replica.",
           [(f'{{replica="{r}"}}', door.index.num_blocks(r)) for r, _ in reps])  # fmt: skip
    metric("requests_in_flight", "gauge", "Requests this front door has admitted and not "
           "finished.", [("", float(door.load.in_flight()))])  # fmt: skip
    metric("replica_requests_in_flight", "gauge", "This front door's requests in flight per "
           "replica.", [(f'{{replica="{r}"}}', float(door.load.in_flight_at(r)))
                        for r, _ in reps])  # fmt: skip
    reports = [(r, door.load.last_report(r)) for r, _ in reps]
    metric("replica_kv_blocks_total", "gauge", "KV cache blocks per replica.",
           [(f'{{replica="{r}"}}', float(x.info.num_blocks)) for r, x in reps])  # fmt: skip
    metric("replica_kv_blocks_free", "gauge", "Free KV blocks per replica, as its latest load "
           "report said.", [(f'{{replica="{r}"}}', float(rep.free_blocks))
                            for r, rep in reports if rep is not None])  # fmt: skip
    metric("replica_requests_waiting", "gauge", "Requests queued on the replica (all front "
           "doors'), as its latest load report said.",
           [(f'{{replica="{r}"}}', float(rep.num_waiting))
            for r, rep in reports if rep is not None])  # fmt: skip
    metric("replica_requests_running", "gauge", "Requests running on the replica (all front "
           "doors'), as its latest load report said.",
           [(f'{{replica="{r}"}}', float(rep.num_running))
            for r, rep in reports if rep is not None])  # fmt: skip
    live = events or {}
    retired = door.retired_event_stats
    names = sorted(set(live) | set(retired))

    def total(rid: str, field: str) -> float:
        st = live.get(rid)
        extra = (
            0 if field != "restarts" or rid not in door.replicas else door.replicas[rid].restarts
        )
        return (getattr(st, field) if st else 0) + retired.get(rid, {}).get(field, 0) + extra

    for field, help_ in (
        ("delivered", "Event batches applied to the index."),
        ("gaps", "Event seq gaps detected (recovered by replay or snapshot)."),
        ("restarts", "Replica restarts: seen on the event stream, or a new process followed."),
        ("resets", "Times a replica's indexed state was dropped and rebuilt."),
    ):
        metric(f"events_{field}_total", "counter", help_,
               [(f'{{replica="{r}"}}', total(r, field)) for r in names])  # fmt: skip
    return "\n".join(lines) + "\n"
