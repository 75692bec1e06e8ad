"""LoRA adapters in the kv price: what a request's adapter costs it on each replica, in seconds.

A replica serving adapters keeps ``S`` of them in device slots (``--max-loras``) and more in
host memory; one step mixes at most ``S`` adapters, so a request whose adapter is not among
those its running requests use waits while ``S`` others run (the engine's scheduler rule).
Each replica reports its slots, the adapters resident in them, those its running requests
hold, and those in host memory (:class:`~kvroute.events.load.LoadReport`), and what one load
costs it (:meth:`~kvroute.events.load.CostCoefficients.adapter_load_s`, measured). From these
and its own placements since the report, the router prices adapter ``a`` on replica ``r``::

    load  = 0                                 a resident in r's slots (reported, or placed
                                                there by this router since the report)
          = copy * (1 + B) + read             otherwise: ``copy`` host -> slot, made on the
                                                step, so each of the ``B`` requests in r's
                                                running batch waits it out too; ``read``
                                                disk -> host when r's host memory does not
                                                hold it (a loader thread: only this request
                                                waits)
    wait  = drain / 2 * (|U + a| - S)         U: the adapters r's running requests and this
            when a is not in U and |U| >= S   router's requests in flight there hold; each
                                                of them beyond S must drain before a runs,
                                                the first when its running request ends: on
                                                average half way through its decode
                                                (``drain``: one request's decode there, the
                                                kv price's own decode term)
    hold  = W * delay                         a runs in r, and ``W`` of this router's
            (added to wait)                     requests there wait for a slot: each
                                                running adapter's slot frees when its
                                                last request ends (with ``n`` in flight,
                                                ``drain * n / (n + 1)`` from now); one more
                                                request of a moves a's to ``drain``, and
                                                the waiting requests get the first slot to
                                                free later by ``delay`` (0 unless a would
                                                have freed it first)
    evict = min(1, rate_v * drain) * copy_v   a is not resident and no slot is free: the
                                                slot of ``v``, the idle resident adapter
                                                this router sent there least recently (the
                                                engine's LRU, as seen from here), is taken;
                                                ``v`` is
                                                copied in again (``copy * (1 + B)``: it
                                                stays in host memory) if one of its requests
                                                comes while a holds it (``rate_v``: its
                                                requests routed to r per second, decayed)

Why these terms and nothing else: each is seconds a request waits or makes others wait on
that replica's own hardware, as the rest of kv's price (:mod:`.policy`). A hot adapter's
holder keeps its traffic while the load, wait and evict it saves elsewhere outweigh its
queue, then a second replica takes a copy; a cold adapter goes where a slot is free or idle
instead of queueing behind busy ones (not starved); a slot whose adapter is still in demand
is not taken for one request (no thrash at the slot limit); and the adapter whose slot a
waiting request will get is not fed more requests there while it can run elsewhere, else
vLLM's admission rule (running adapters first) lets a steadily fed holder keep its slot
and the waiting request waits on (the coldest adapters' tail at a fleet's limit). No
weight is tuned to a workload.

Invariants:
- a request without an adapter pays nothing here, and so does every request when the policy
  prices blind (``kv:lora_blind``);
- a replica that reports no slots (a vLLM engine, an older kvroute) pays only the load, and
  none once this router placed the adapter there within ``placed_ttl_s``;
- prices never go negative; this router's in-flight counts return to zero when its requests
  end (finished, aborted, or dropped with their replica).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvroute.events.load import CostCoefficients, LoadReport

# Demand's memory: a request routed this long ago counts half (exponential decay). Long
# beside one request's service (seconds), short beside a tenant's day: recent demand.
DEMAND_HALF_LIFE_S = 30.0


@dataclass(slots=True)
class _Adapters:
    """What this router knows of one replica's adapters beyond its last report."""

    placed: dict[str, float] = field(default_factory=dict)  # adapter -> last placement here
    in_flight: dict[str, int] = field(default_factory=dict)  # adapter -> requests in flight
    demand: dict[str, tuple[float, float]] = field(default_factory=dict)  # (count, at)


class AdapterTracker:
    """Per replica: adapters placed, in flight and in demand, beside the replicas' reports
    (read through ``reports``: replica -> (its last report, when it was taken))."""

    def __init__(self, placed_ttl_s: float = 10.0, half_life_s: float = DEMAND_HALF_LIFE_S):
        self.placed_ttl_s = placed_ttl_s
        self._decay = math.log(2.0) / half_life_s
        self._reps: dict[str, _Adapters] = {}
        # request -> (replica, adapter); the policy looks here before it calls finished
        self.flights: dict[str, tuple[str, str]] = {}

    def _rep(self, replica: str) -> _Adapters:
        rep = self._reps.get(replica)
        if rep is None:
            rep = self._reps[replica] = _Adapters()
        return rep

    def rate(self, replica: str, adapter: str, now: float) -> float:
        """Requests of ``adapter`` this router sent to ``replica`` per second, recently."""
        rep = self._reps.get(replica)
        got = rep.demand.get(adapter) if rep is not None else None
        if got is None:
            return 0.0
        count, at = got
        return count * math.exp(-self._decay * max(now - at, 0.0)) * self._decay

    # -- this router's requests -----------------------------------------------------------
    def routed(self, request_id: str, replica: str, adapter: str, now: float) -> None:
        self.finished(request_id)
        rep = self._rep(replica)
        rep.placed[adapter] = now
        rep.in_flight[adapter] = rep.in_flight.get(adapter, 0) + 1
        count, at = rep.demand.get(adapter, (0.0, now))
        rep.demand[adapter] = (count * math.exp(-self._decay * max(now - at, 0.0)) + 1.0, now)
        self.flights[request_id] = (replica, adapter)

    def finished(self, request_id: str) -> None:
        got = self.flights.pop(request_id, None)
        if got is None:
            return
        replica, adapter = got
        rep = self._reps.get(replica)
        if rep is not None:
            left = rep.in_flight.get(adapter, 0) - 1
            if left > 0:
                rep.in_flight[adapter] = left
            else:
                rep.in_flight.pop(adapter, None)

    def drop_replica(self, replica: str) -> None:
        self._reps.pop(replica, None)
        for rid in [rid for rid, (r, _) in self.flights.items() if r == replica]:
            del self.flights[rid]

    # -- what the replica holds -----------------------------------------------------------
    def resident(
        self, replica: str, adapter: str, report: LoadReport | None, report_at: float, now: float
    ) -> bool:
        """In its slots: reported there, or placed there by this router since the report
        (within ``placed_ttl_s``: a placement whose request never arrived is forgotten)."""
        if report is not None and adapter in report.lora_resident:
            return True
        rep = self._reps.get(replica)
        at = rep.placed.get(adapter) if rep is not None else None
        return at is not None and at >= report_at and now - at <= self.placed_ttl_s

    def price(
        self,
        c: CostCoefficients,
        replica: str,
        adapter: str,
        report: LoadReport | None,
        report_at: float,
        drain_s: float,
        batch: float,
        now: float,
    ) -> tuple[float, float, float]:
        """(load, wait with hold, evict) seconds of ``adapter`` on ``replica`` (module docstring);
        ``report``: its latest (None: none yet), taken at ``report_at``; ``drain_s``: one
        request's decode there; ``batch``: the requests a step there holds up."""
        copy = c.adapter_load_s(True) * (1.0 + batch)
        if self.resident(replica, adapter, report, report_at, now):
            load = 0.0
            resident = True
        else:
            in_host = report is not None and adapter in report.lora_host
            load = copy + (0.0 if in_host else c.adapter_load_s(False) - c.adapter_load_s(True))
            resident = False
        slots = report.lora_slots if report is not None else 0
        if not slots:
            return load, 0.0, 0.0
        assert report is not None
        rep = self._reps.get(replica)
        busy = set(report.lora_running)
        placed_new: set[str] = set()
        if rep is not None:
            busy.update(rep.in_flight)
            placed_new = {
                a for a, at in rep.placed.items()
                if at >= report_at and now - at <= self.placed_ttl_s
                and a not in report.lora_resident
            }  # fmt: skip
        wait = 0.0
        if adapter not in busy and len(busy) >= slots:
            wait = 0.5 * drain_s * (len(busy) + 1 - slots)
        in_flight = rep.in_flight if rep is not None else {}
        if adapter in report.lora_running and len(busy) > slots:
            wait += _hold(adapter, report.lora_running, busy, slots, in_flight, drain_s)
        evict = 0.0
        if not resident and report.lora_free_slots - len(placed_new) <= 0:
            idle = [a for a in (*report.lora_resident, *placed_new) if a not in busy]
            if idle:  # a slotted adapter stays in host memory: its reload is host -> slot
                last = rep.placed if rep is not None else {}
                victim = min(idle, key=lambda a: last.get(a, float("-inf")))
                evict = min(1.0, self.rate(replica, victim, now) * drain_s) * copy
        return load, wait, evict


def _hold(
    adapter: str,
    running: tuple[str, ...],
    busy: set[str],
    slots: int,
    in_flight: dict[str, int],
    drain_s: float,
) -> float:
    """Seconds a new request of running ``adapter`` adds to the waits of requests queued
    for a slot there (``hold``, module docstring). Each running adapter keeps its slot
    until its last request ends: with ``n`` requests, ``drain * n / (n + 1)`` from now (the
    latest of ``n`` remaining decodes, each uniform over one); a new request moves that to
    ``drain``. The first waiting adapter gets the first slot to free, so only a delay of
    that first drain counts, once per waiting request: of the ``|busy| - slots`` waiting
    adapters that no free slot takes, each with the waiting adapters' mean requests."""

    def ends(a: str) -> float:
        n = max(in_flight.get(a, 0), 1)
        return drain_s * n / (n + 1)

    others = min((ends(a) for a in running if a != adapter), default=math.inf)
    delay = min(drain_s, others) - min(ends(adapter), others)
    if delay <= 0.0:
        return 0.0
    waiting = [a for a in busy if a not in running]
    claimants = (len(busy) - slots) / max(len(waiting), 1)
    return delay * claimants * sum(max(in_flight.get(a, 0), 1) for a in waiting)
