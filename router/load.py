"""Router-side load accounting: what each replica has in flight, as this router sees it.

The router knows every request it routed, when its first token streamed back and when it
ended, so it can count, per replica, the prefill tokens still queued and the KV context of
requests decoding -- without waiting for any report. Replicas' own load reports (which also
see preemptions and other routers' traffic) are folded in by taking, per replica, the larger
of the two while a report is fresh.

Invariants:
- every in-flight request is in ``_flights`` under exactly one replica, and that replica's
  ``prefill`` / ``decode`` / ``count`` sums equal the sums over its flights (prefill counts
  until the first token, decode context after it);
- sums never go negative; a request finished, aborted or dropped with its replica leaves
  no trace.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class _Flight:
    replica: str
    prefill: int  # uncached prompt tokens the router expects the replica to compute
    context: int  # KV tokens it will hold while decoding
    decoding: bool = False


@dataclass(slots=True)
class ReplicaLoad:
    prefill: int = 0  # queued prefill tokens (not yet first token)
    decode: int = 0  # KV context tokens of requests past their first token
    count: int = 0  # requests in flight
    report_prefill: int = 0
    report_decode: int = 0
    report_count: int = 0
    report_expiry: float = float("-inf")


class LoadTracker:
    """Per-replica in-flight prefill, decode context and request count."""

    def __init__(self, report_ttl_s: float = 1.0) -> None:
        self.report_ttl_s = report_ttl_s
        self._flights: dict[str, _Flight] = {}
        self._loads: dict[str, ReplicaLoad] = {}

    def _load(self, replica: str) -> ReplicaLoad:
        load = self._loads.get(replica)
        if load is None:
            load = self._loads[replica] = ReplicaLoad()
        return load

    def on_routed(self, request_id: str, replica: str, prefill: int, context: int) -> None:
        if request_id in self._flights:
            self.on_finished(request_id)
        self._flights[request_id] = _Flight(replica, prefill, context)
        load = self._load(replica)
        load.prefill += prefill
        load.count += 1

    def on_first_token(self, request_id: str) -> None:
        f = self._flights.get(request_id)
        if f is None or f.decoding:
            return
        f.decoding = True
        load = self._load(f.replica)
        load.prefill -= f.prefill
        load.decode += f.context

    def on_finished(self, request_id: str) -> None:
        f = self._flights.pop(request_id, None)
        if f is None:
            return
        load = self._load(f.replica)
        if f.decoding:
            load.decode -= f.context
        else:
            load.prefill -= f.prefill
        load.count -= 1

    def report(self, replica: str, prefill: int, decode: int, count: int, now: float) -> None:
        """The replica's own figures (waiting + partial prefill tokens, decode context)."""
        load = self._load(replica)
        load.report_prefill, load.report_decode, load.report_count = prefill, decode, count
        load.report_expiry = now + self.report_ttl_s

    def drop_replica(self, replica: str) -> list[str]:
        """Forget a replica; returns the ids of the requests that were in flight there."""
        gone = [rid for rid, f in self._flights.items() if f.replica == replica]
        for rid in gone:
            del self._flights[rid]
        self._loads.pop(replica, None)
        return gone

    def get(self, replica: str, now: float) -> tuple[int, int, int]:
        """(queued prefill tokens, decode context tokens, requests in flight)."""
        load = self._loads.get(replica)
        if load is None:
            return 0, 0, 0
        if load.report_expiry < now:
            return load.prefill, load.decode, load.count
        return (
            max(load.prefill, load.report_prefill),
            max(load.decode, load.report_decode),
            max(load.count, load.report_count),
        )

    def in_flight(self) -> int:
        return len(self._flights)
