"""The scheduler's waiting queue: round-robin across tenants, first come first served within one.

Why not one FCFS deque: a batch engine admits waiting requests in queue order, so a tenant
that queued fifty long requests ahead of another tenant's two-token request made it wait for
all fifty. Here each tenant has its own deque, and the tenants take turns: after a request
of a tenant is admitted, that tenant goes to the back of the ring. A newcomer joins the back
of the ring, so it waits for at most one admission of each tenant already queued.

Requests with no tenant form one group of their own; with one group the queue is exactly the
FCFS deque it replaces. A preempted request goes back to the front of its tenant's deque and
its tenant to the front of the ring: it had its turn already, and admitting it again first
keeps the recompute it costs short (the single-group behaviour, unchanged).

Every operation but :meth:`remove` (a waiting request aborted: O(its tenant's queue)) and
iteration is O(1).

:class:`TenantUsage` decides who gets a step's prompt tokens when tenants compete: the
least served first (a virtual token counter, after Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
_END = object()


class FairQueue(Generic[T]):
    """Waiting items grouped by ``key(item)`` (the tenant), served round-robin by group."""

    def __init__(self, key: Callable[[T], Hashable]) -> None:
        self._key = key
        # The ring: the first group is served next; each group's deque is never empty.
        self._groups: OrderedDict[Hashable, deque[T]] = OrderedDict()
        self._len = 0

    def append(self, item: T) -> None:
        """Queues ``item`` last in its group; a new group joins the back of the ring."""
        group = self._key(item)
        queue = self._groups.get(group)
        if queue is None:
            queue = self._groups[group] = deque()
        queue.append(item)
        self._len += 1

    def appendleft(self, item: T) -> None:
        """Queues ``item`` (preempted) first in its group, and its group first in the ring."""
        group = self._key(item)
        queue = self._groups.get(group)
        if queue is None:
            queue = self._groups[group] = deque()
        queue.appendleft(item)
        self._groups.move_to_end(group, last=False)
        self._len += 1

    def peek(self) -> T:
        """The item served next; IndexError when empty."""
        if not self._groups:
            raise IndexError("peek from an empty FairQueue")
        return next(iter(self._groups.values()))[0]

    def popleft(self) -> T:
        """Takes the item served next; its group goes to the back of the ring."""
        if not self._groups:
            raise IndexError("pop from an empty FairQueue")
        group, queue = next(iter(self._groups.items()))
        item = queue.popleft()
        if queue:
            self._groups.move_to_end(group)
        else:
            del self._groups[group]
        self._len -= 1
        return item

    def rotate(self) -> None:
        """Sends the group served next to the back of the ring, its items unmoved (it has
        had its share of this step)."""
        if self._groups:
            self._groups.move_to_end(next(iter(self._groups)))

    def heads(self) -> list[T]:
        """Each group's next item, in ring order."""
        return [q[0] for q in self._groups.values()]

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def remove(self, item: T) -> None:
        """Takes ``item`` out wherever it waits; ValueError when it is not queued."""
        group = self._key(item)
        queue = self._groups.get(group)
        if queue is None:
            raise ValueError("item not in FairQueue")
        queue.remove(item)
        if not queue:
            del self._groups[group]
        self._len -= 1

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[T]:
        """In the order they would be served if nothing else arrived: the groups' heads in
        ring order, then their second items, and so on."""
        iters = [iter(q) for q in self._groups.values()]
        while iters:
            alive = []
            for it in iters:
                item = next(it, _END)
                if item is not _END:
                    alive.append(it)
                    yield item  # type: ignore[misc]
            iters = alive


class TenantUsage:
    """Tokens computed per tenant while it has live requests: the tenant with the smallest
    count is served first.

    Invariants: only tenants seen since the engine was last idle are counted; a tenant that
    becomes live while others are is lifted to the smallest live count, so time spent idle
    is never banked as credit against tenants that kept the engine busy (a returning tenant
    is not owed the past, and a flooder is not punished for it); the counts of two
    continuously live tenants differ by at most what one step can charge one of them, so
    none starves."""

    def __init__(self) -> None:
        self._count: dict[Hashable, float] = {}
        self._live: dict[Hashable, int] = {}  # live requests per tenant (absent: none)

    def arrived(self, tenant: Hashable) -> None:
        """A request of ``tenant`` went live (queued)."""
        if tenant not in self._live:
            if not self._live:
                self._count.clear()  # the engine was idle: everyone starts equal
            floor = min((self._count.get(t, 0.0) for t in self._live), default=0.0)
            self._count[tenant] = max(self._count.get(tenant, 0.0), floor)
        self._live[tenant] = self._live.get(tenant, 0) + 1

    def left(self, tenant: Hashable) -> None:
        """A request of ``tenant`` finished or was aborted."""
        n = self._live[tenant] - 1
        if n:
            self._live[tenant] = n
        else:
            del self._live[tenant]

    def charge(self, tenant: Hashable, num_tokens: int) -> None:
        self._count[tenant] = self._count.get(tenant, 0.0) + num_tokens

    def count(self, tenant: Hashable) -> float:
        return self._count.get(tenant, 0.0)

    def live(self, tenant: Hashable) -> int:
        """The tenant's live requests."""
        return self._live.get(tenant, 0)

    @property
    def num_live_tenants(self) -> int:
        """Tenants with live requests: fewer than two cannot compete."""
        return len(self._live)
