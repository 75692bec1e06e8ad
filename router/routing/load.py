"""The router's load view: each replica's own reports, filled in by in-flight accounting.

A replica reports its load (:class:`~kvroute.events.load.LoadReport`) every short interval;
every front door sees the same reports, so several front doors agree. Between reports a
router knows what it routed itself: per replica, the prefill tokens it expects the replica
to compute (until the first token streams back), the KV context of requests decoding, and
the KV blocks they will hold. The view takes, per figure, the larger of the report and the
router's own count while the report is fresh (a report also sees other routers' traffic and
preemptions; the router's count sees what it routed after the report was taken), and free
blocks as the report's minus what this router has placed since.

Replicas register their :class:`~kvroute.events.load.CostCoefficients` (from their info),
so a policy can price each one in its own seconds.

Invariants:
- every in-flight request is in ``_flights`` under exactly one replica, and that replica's
  ``prefill`` / ``decode`` / ``decoding`` / ``count`` / ``blocks`` sums equal the sums over
  its flights (prefill counts until the first token, decode context after it);
- sums never go negative; a request finished, aborted or dropped with its replica leaves
  no trace.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.events.load import CostCoefficients, LoadReport

# A view: (queued prefill tokens, decode context tokens, decoding requests, requests in
# flight, free KV blocks, total KV blocks -- 0 when not known yet). Tuples, not objects: the
# policy reads one per replica per request.
LoadView = tuple[int, int, int, int, int, int]
_NO_LIMIT = 1 << 40  # free blocks of a replica whose KV size is not known yet


@dataclass(slots=True)
class _Flight:
    replica: str
    prefill: int  # uncached prompt tokens the router expects the replica to compute
    context: int  # KV tokens it will hold while decoding
    blocks: int  # KV blocks it will hold (uncached prompt + expected output)
    decoding: bool = False


@dataclass(slots=True)
class ReplicaLoad:
    """One replica as this router sees it: its coefficients, its last report, its flights."""

    coefficients: CostCoefficients | None = None
    total_blocks: int = 0
    prefill: int = 0  # queued prefill tokens (requests before their first token)
    decode: int = 0  # KV context tokens of requests past their first token
    decoding: int = 0  # requests past their first token
    count: int = 0  # requests in flight
    blocks: int = 0  # KV blocks this router's flights will hold
    report: LoadReport | None = None
    report_expiry: float = float("-inf")
    report_at: float = float("-inf")  # when the report arrived (or was last confirmed)
    blocks_at_report: int = 0  # ``blocks`` when the report arrived


class LoadTracker:
    """Per-replica load: fresh reports merged with this router's in-flight accounting."""

    def __init__(self, report_ttl_s: float = 1.0, prior_output_tokens: int = 256) -> None:
        self.report_ttl_s = report_ttl_s
        self._flights: dict[str, _Flight] = {}
        self._loads: dict[str, ReplicaLoad] = {}
        # Mean output length of finished requests (a prior of 8 requests' weight): what a
        # request with no max_tokens is expected to generate.
        self._out_sum = 8.0 * prior_output_tokens
        self._out_n = 8.0

    def _load(self, replica: str) -> ReplicaLoad:
        load = self._loads.get(replica)
        if load is None:
            load = self._loads[replica] = ReplicaLoad()
        return load

    def register(self, replica: str, coefficients: CostCoefficients, total_blocks: int) -> None:
        """A replica's cost coefficients and KV size, from its info (again after a restart)."""
        load = self._load(replica)
        load.coefficients, load.total_blocks = coefficients, total_blocks

    def coefficients(self, replica: str) -> CostCoefficients | None:
        load = self._loads.get(replica)
        return load.coefficients if load is not None else None

    # -- this router's requests ------------------------------------------------------------
    def on_routed(
        self, request_id: str, replica: str, prefill: int, context: int, blocks: int = 0
    ) -> None:
        if request_id in self._flights:
            self.on_finished(request_id)
        self._flights[request_id] = _Flight(replica, prefill, context, blocks)
        load = self._load(replica)
        load.prefill += prefill
        load.count += 1
        load.blocks += blocks

    def on_first_token(self, request_id: str) -> None:
        f = self._flights.get(request_id)
        if f is None or f.decoding:
            return
        f.decoding = True
        load = self._load(f.replica)
        load.prefill -= f.prefill
        load.decode += f.context
        load.decoding += 1

    def on_finished(self, request_id: str, output_tokens: int | None = None) -> None:
        if output_tokens is not None and output_tokens > 0:
            self._out_sum += output_tokens
            self._out_n += 1
        f = self._flights.pop(request_id, None)
        if f is None:
            return
        load = self._load(f.replica)
        if f.decoding:
            load.decode -= f.context
            load.decoding -= 1
        else:
            load.prefill -= f.prefill
        load.count -= 1
        load.blocks -= f.blocks
        load.blocks_at_report = min(load.blocks_at_report, load.blocks)

    def expected_output_tokens(self, max_tokens: int | None = None) -> float:
        """The mean output of finished requests, capped by the request's ``max_tokens``."""
        mean = self._out_sum / self._out_n
        return float(min(mean, max_tokens)) if max_tokens else mean

    # -- replicas' reports -----------------------------------------------------------------
    def report(self, replica: str, report: LoadReport, now: float, good_for_s: float = 0.0) -> None:
        """A replica's own figures; fresh for ``report_ttl_s``, plus ``good_for_s`` for a
        report its source stands by until then (an HTTP backend's, read again only when
        due: the fleet's monitor need not wake to confirm it meanwhile)."""
        load = self._load(replica)
        if report is not load.report:  # the same one confirmed: placed since it was read
            load.blocks_at_report = load.blocks
        load.report, load.report_at = report, now
        load.report_expiry = now + self.report_ttl_s + good_for_s
        if not load.total_blocks:
            load.total_blocks = report.total_blocks

    def forget(self, replica: str) -> None:
        """A replica gone for good: nothing of it is kept (see :meth:`drop_replica`)."""
        self.drop_replica(replica)
        self._loads.pop(replica, None)

    def drop_replica(self, replica: str) -> list[str]:
        """Forget a replica's load (not its coefficients: it may come back); returns the ids
        of the requests that were in flight there."""
        gone = [rid for rid, f in self._flights.items() if f.replica == replica]
        for rid in gone:
            del self._flights[rid]
        old = self._loads.pop(replica, None)
        if old is not None and old.coefficients is not None:
            self.register(replica, old.coefficients, old.total_blocks)
        return gone

    # -- the view --------------------------------------------------------------------------
    def get(self, replica: str, now: float) -> LoadView:
        """(queued prefill tokens, decode context tokens, decoding requests, requests in
        flight, free KV blocks, total KV blocks: 0 while the replica's size is unknown)."""
        load = self._loads.get(replica)
        if load is None:
            return 0, 0, 0, 0, _NO_LIMIT, 0
        rep = load.report
        total = load.total_blocks
        if rep is None or load.report_expiry < now:
            free = total - load.blocks if total else _NO_LIMIT
            return load.prefill, load.decode, load.decoding, load.count, free, total
        placed = load.blocks - load.blocks_at_report  # placed since the report was taken
        return (
            max(load.prefill, rep.queued_prefill_tokens),
            max(load.decode, rep.decode_context_tokens),
            max(load.decoding, rep.num_decoding),
            max(load.count, rep.num_waiting + rep.num_running),
            rep.free_blocks - max(placed, 0),
            total,
        )

    def in_flight(self) -> int:
        return len(self._flights)

    def in_flight_at(self, replica: str) -> int:
        """This router's requests in flight at ``replica``."""
        load = self._loads.get(replica)
        return load.count if load is not None else 0

    def report_of(self, replica: str) -> tuple[LoadReport | None, float]:
        """The replica's latest report, however old, and when it arrived (-inf: none)."""
        load = self._loads.get(replica)
        if load is None or load.report is None:
            return None, float("-inf")
        return load.report, load.report_at

    def last_report(self, replica: str) -> LoadReport | None:
        """The replica's latest report, however old (for /metrics; routing uses get())."""
        load = self._loads.get(replica)
        return load.report if load is not None else None
