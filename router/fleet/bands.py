"""The waiting room of flow control (:mod:`.flow`): requests that wait at the front door, in
the order they are to leave it.

Why its own structure: the order -- priority first, then the tenant least served, then
first come first served -- is what makes a flooding tenant unable to hold back a quiet one
or an urgent band, and it is easier to hold its invariants in one small class than spread
through the controller that decides *when* a request leaves (room, deadlines).

The data structure: one band per priority (vLLM's meaning: lower runs first), each a FIFO
per tenant; ``order`` is the bands that hold a waiter, most urgent first. Each tenant has a
virtual token counter (as the replicas' ``TenantUsage``): a dispatch while others wait
charges the request's cost (prompt tokens plus its output bound, capped); a tenant that
starts waiting is lifted to the least counter of the tenants waiting, so idle time is never
banked; the counters clear when nothing waits.

Invariants:
- ``waiting`` (and ``len(self)``) equals the waiters in the bands, and ``length(b)`` those
  in band ``b``;
- ``order`` is sorted and holds exactly the bands with a waiter; a band's dict holds only
  tenants with a waiter;
- a waiter is in the bands iff its ``queued`` is True;
- with nothing waiting, no counter is kept.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio


@dataclass(eq=False, slots=True)
class Waiter:
    """One request at the door. ``dispatch(room)`` routes it among ``room`` (the replicas
    with room it may go to; None: no filter) and sends it, raising what the send raises;
    ``eligible()`` the replicas it may go to now."""

    band: int
    tenant: str
    cost: float
    dispatch: Callable[[list[str] | None], None]
    eligible: Callable[[], list[str]]
    deadline: float | None = None  # monotonic seconds; None: none
    seq: int = 0
    since: float = 0.0
    future: asyncio.Future[None] | None = None
    timer: asyncio.TimerHandle | None = None
    queued: bool = False


class Bands:
    """Waiters by priority band, then tenant (see the module's docstring)."""

    def __init__(self) -> None:
        self._bands: dict[int, dict[str, deque[Waiter]]] = {}
        self._length: dict[int, int] = {}
        self.order: list[int] = []  # bands holding a waiter, most urgent first
        self._counter: dict[str, float] = {}  # tenant -> virtual tokens served
        self._seq = itertools.count()
        # A plain attribute, not only __len__: flow control reads it on every request, and
        # a request that finds nothing waiting never calls into this module.
        self.waiting = 0

    def __len__(self) -> int:
        return self.waiting

    def length(self, band: int) -> int:
        return self._length.get(band, 0)

    def lengths(self) -> dict[int, int]:
        """Waiters per band (bands that hold one)."""
        return dict(self._length)

    def ahead_of(self, band: int) -> int:
        """Waiters that go before a newcomer of ``band``: its band and the more urgent."""
        return sum(self._length[b] for b in self.order if b <= band)

    def push(self, w: Waiter) -> None:
        """``w`` waits, last of its tenant in its band."""
        w.seq = next(self._seq)
        w.queued = True
        tenants = self._bands.get(w.band)
        if tenants is None:
            tenants = self._bands[w.band] = {}
            bisect.insort(self.order, w.band)
        self._length[w.band] = self._length.get(w.band, 0) + 1
        if not self._live(w.tenant):  # starts waiting: lifted, never banked
            floor = min((self._counter.get(t, 0.0) for t in self._tenants()), default=0.0)
            self._counter[w.tenant] = max(self._counter.get(w.tenant, 0.0), floor)
        fifo = tenants.get(w.tenant)
        if fifo is None:
            fifo = tenants[w.tenant] = deque()
        fifo.append(w)
        self.waiting += 1

    def remove(self, w: Waiter) -> None:
        """Takes ``w`` out of its band (it is queued)."""
        w.queued = False
        tenants = self._bands[w.band]
        fifo = tenants[w.tenant]
        fifo.remove(w)
        if not fifo:
            del tenants[w.tenant]
        n = self._length[w.band] - 1
        if n:
            self._length[w.band] = n
        else:
            del self._length[w.band]
            del self._bands[w.band]
            self.order.remove(w.band)
        self.waiting -= 1
        if not self.waiting:
            self._counter.clear()  # nothing waits: everyone starts equal

    def charge(self, tenant: str, cost: float) -> None:
        """A request of ``tenant`` was dispatched while others wait (with none waiting every
        count clears, so nothing is charged)."""
        if self.waiting:
            self._counter[tenant] = self._counter.get(tenant, 0.0) + cost

    def heads(self) -> Iterator[Waiter]:
        """Each tenant's first waiter, in dispatch order: the most urgent band first; in a
        band, the tenant with the least counter (ties: the older head). Read it only until
        the bands change."""
        for band in self.order:
            tenants = self._bands[band]
            yield from sorted(
                (q[0] for q in tenants.values()),
                key=lambda h: (self._counter.get(h.tenant, 0.0), h.seq),
            )

    def _live(self, tenant: str) -> bool:
        return any(tenant in tenants for tenants in self._bands.values())

    def _tenants(self) -> set[str]:
        return {t for tenants in self._bands.values() for t in tenants}
