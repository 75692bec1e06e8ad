"""The scheduler's waiting queue by priority, then fair across tenants, and where a newly
admitted request goes among the running ones.

``priority`` has vLLM's meaning: an int, lower runs first, default 0, negative allowed.
Waiting requests are served from the most urgent level present; within one level by the
tenants' round-robin ring of :class:`~.fair_queue.FairQueue` (FCFS within a tenant). With a
single level (every request at the default) the queue is exactly that FairQueue, so a
priority-less engine behaves as before to the step.

Cost: one FairQueue per level present and a sorted list of the levels; an operation costs
what the FairQueue's does plus O(#levels) when a level appears or empties.

The running list is kept sorted by priority, admission order within a level
(:func:`insert_running`): the scheduler serves running requests in that order, so the most
urgent get the step's token budget first, and the last running request is always the least
urgent and newest: the one preemption takes (:func:`victim_for`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, Protocol, TypeVar

from .fair_queue import FairQueue


class _Prioritized(Protocol):
    @property
    def priority(self) -> int: ...


T = TypeVar("T", bound=_Prioritized)


class PriorityFairQueue(Generic[T]):
    """FairQueues keyed by priority; every method reads or changes the most urgent level,
    except :meth:`append`, :meth:`appendleft` and :meth:`remove` (the item's own level)."""

    def __init__(self, key: Callable[[T], Hashable]) -> None:
        self._key = key
        self._queues: dict[int, FairQueue[T]] = {}
        self._levels: list[int] = []  # sorted, most urgent first; each level's queue non-empty
        self._len = 0

    def _queue_for(self, item: T) -> FairQueue[T]:
        level = item.priority
        queue = self._queues.get(level)
        if queue is None:
            queue = self._queues[level] = FairQueue(self._key)
            bisect.insort(self._levels, level)
        return queue

    def _drop_if_empty(self, level: int) -> None:
        if not self._queues[level]:
            del self._queues[level]
            self._levels.remove(level)

    def append(self, item: T) -> None:
        """Queues ``item`` last in its tenant's group of its level."""
        self._queue_for(item).append(item)
        self._len += 1

    def appendleft(self, item: T) -> None:
        """Queues ``item`` (preempted, or back from a load) first in its level."""
        self._queue_for(item).appendleft(item)
        self._len += 1

    def _top(self) -> FairQueue[T]:
        if not self._levels:
            raise IndexError("empty PriorityFairQueue")
        return self._queues[self._levels[0]]

    def peek(self) -> T:
        """The item served next; IndexError when empty."""
        return self._top().peek()

    @property
    def top_priority(self) -> int | None:
        """The most urgent level waiting (None: nobody waits)."""
        return self._levels[0] if self._levels else None

    def popleft(self) -> T:
        """Takes the item served next (its tenant goes to the back of its level's ring)."""
        level = self.top_priority
        item = self._top().popleft()
        self._drop_if_empty(level)  # type: ignore[arg-type]
        self._len -= 1
        return item

    def rotate(self) -> None:
        """Passes over the next tenant of the most urgent level (its share is spent)."""
        if self._levels:
            self._top().rotate()

    def heads(self) -> list[T]:
        """The most urgent level's tenants' next items, in ring order (the requests that
        could be admitted next)."""
        return self._top().heads() if self._levels else []

    @property
    def num_groups(self) -> int:
        """Tenants in the most urgent level: how often :meth:`rotate` can pass one over."""
        return self._top().num_groups if self._levels else 0

    @property
    def num_levels(self) -> int:
        return len(self._levels)

    def remove(self, item: T) -> None:
        """Takes ``item`` out wherever it waits; ValueError when it is not queued."""
        queue = self._queues.get(item.priority)
        if queue is None:
            raise ValueError("item not in PriorityFairQueue")
        queue.remove(item)
        self._drop_if_empty(item.priority)
        self._len -= 1

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[T]:
        """In the order they would be served if nothing else arrived: level by level."""
        for level in list(self._levels):
            yield from self._queues[level]


def _priority_of(req: _Prioritized) -> int:
    return req.priority


def insert_running(running: list[T], req: T) -> int:
    """Puts a newly admitted ``req`` after every running request at its level or a more
    urgent one (at the end when all are equal: admission order, as before); returns where."""
    at = len(running)
    if at and running[-1].priority > req.priority:
        at = bisect.bisect_right(running, req.priority, key=_priority_of)
    running.insert(at, req)
    return at


def victim_for(running: list[T], start: int, urgent: T) -> T | None:
    """The running request to preempt so that ``urgent`` can be admitted: the last one (the
    least urgent, newest admitted) when it is strictly less urgent than ``urgent`` and at
    index ``start`` or later (not yet given slots this step: a request whose slots this step
    registered blocks must run the step, or the prefix cache would name KV never written);
    None: nobody may be preempted for it."""
    if len(running) > start and running[-1].priority > urgent.priority:
        return running[-1]
    return None
