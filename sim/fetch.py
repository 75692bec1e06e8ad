"""Prefix fetch in the simulator: a request placed on one replica pulls its prefix from the
replica that holds it (issue 51, item 3; the router's side is
:mod:`kvroute.router.routing.fetch`, the engine's :mod:`kvroute.replica.kv_transfer.leases`).

A run whose policy name carries the fleet variant ``fetch`` (``kv:fetch``) gives every
replica what ``--prefix-fetch`` gives a live one: a transfer plane (the engine's
:class:`~kvroute.replica.kv_transfer.leases.Leases` to serve pins, and P/D's
:class:`~.disagg.SimPulls` to pull), and the ``kv`` policy a say in fetching
(``KVPolicy.fetchable``: every replica). What happens then is P/D's pull, with one
difference, as in the engine:

- **routing**: the policy's :class:`~kvroute.router.routing.policy.Decision` names the
  holder (``fetch_from``); the request goes to its replica with a :class:`FetchPull` as its
  source, holding no lease yet;
- **the pin**: when the request reaches the head of its replica's queue, the holder pins
  what its cache still holds of the prompt's chain, from its first block
  (:meth:`Leases.pin_cached`; in the engine its thread does so at its next poll, a step at
  most: not modelled). Nothing held any more (evicted since the router's index heard): the
  request computes it all;
- **the pull**: then as P/D's (:meth:`.disagg.Disagg.start`): its own device hit is held,
  the rest of the pin's blocks cross the link (each replica's one NIC, first come first
  served each way), land at its next step, are cached as its own, and the pin ends.

Each replica reports the link's rate before a first pull (the operator's
``--kv-link-gbps``), as P/D's do, so the policy prices a fetch at the fabric's speed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvroute.replica.kv_transfer.leases import Leases

from .disagg import Disagg, Pull, SimPulls

if TYPE_CHECKING:
    from kvroute.replica.core.block_pool import KVCacheBlock
    from kvroute.replica.core.scheduler import Scheduler
    from kvroute.router.routing.policy import Decision

    from .replica import SimRequest

FETCH = "fetch"  # the fleet variant of a run's policy name: kv:fetch


@dataclass(slots=True, eq=False)
class FetchPull(Pull):
    """A fetch's source: the holder, pinned only when the pull starts."""

    num_blocks: int = 0  # of the prompt's chain, from its first, that the holder held


@dataclass(slots=True)
class FetchStats:
    routed: int = 0  # requests the policy placed with a fetch
    pinned: int = 0  # pulls whose holder still held a first block
    missed: int = 0  # the holder held none of it any more: computed
    gone: int = 0  # the holder restarted since: computed


class Fetching(Disagg):
    """P/D's roles, links and pulls, with every replica able to serve and pull a fetch."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.fetch_stats = FetchStats()

    def attach(self, i: int) -> Callable[[Scheduler], None]:
        """Every replica's scheduler: leases (it serves pins) and pulls (it fetches)."""
        inner = super().attach(i)

        def attach(sched: Scheduler) -> None:
            inner(sched)
            kv = sched.kv_cache_manager
            if sched.leases is None:
                sched.use_leases(Leases(kv.block_pool, self.lease_s, self.clock))
            if not isinstance(sched.kv_loads, SimPulls):
                sched.kv_loads = SimPulls(self, i, kv, sched.waiting)  # type: ignore[assignment]
                sched.kv_loads.bytes_per_s = self.link_bytes_per_s  # the operator's figure

        return attach

    def fetch(self, req: SimRequest, decision: Decision, now: float) -> None:
        """``req`` was placed with a fetch from ``decision.fetch_from``: its source."""
        assert self.run is not None and decision.fetch_from is not None
        if req.kv_source is not None:  # a P/D decode part already has one
            return
        src = self.run.replica(decision.fetch_from)
        self.fetch_stats.routed += 1
        req.kv_source = FetchPull(  # type: ignore[assignment]
            req,  # type: ignore[arg-type]
            src,
            src.scheduler,
            None,
            now,
            num_blocks=decision.fetch_blocks,
        )

    def start(self, p: Pull, pulls: SimPulls, hit: list[KVCacheBlock]) -> bool:
        if isinstance(p, FetchPull) and p.lease is None:
            if not p.source_alive:
                self.fetch_stats.gone += 1
                return False
            leases = p.src_sched.leases
            assert leases is not None
            hashes = pulls.kv.block_hashes(p.req)[: p.num_blocks]
            p.lease = leases.pin_cached(hashes)
            if p.lease is None:
                self.fetch_stats.missed += 1
                return False
            self.fetch_stats.pinned += 1
        return super().start(p, pulls, hit)

    def metrics(self) -> dict[str, Any]:
        s = self.fetch_stats
        return {
            **super().metrics(),
            "fetch_routed": s.routed,
            "fetch_pinned": s.pinned,
            "fetch_missed": s.missed,
            "fetch_source_gone": s.gone,
        }
