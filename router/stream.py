"""One routed request's deltas as the HTTP layer reads them, and what ends it.

Why its own object: a request holds shared resources from admission to its end -- its
tenant's share and rate, a slot in the router's budget (handed on to the oldest waiter),
its flight in the load view -- and every way it can end (finished, client gone, replica
failed, cancelled) must give them back exactly once. :meth:`Stream.aclose` is that one
place; iterating a stream also times its tokens for ``/metrics``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from kvroute.events.replica_api import GenerateDelta, ReplicaDeadError, ReplicaLostError

if TYPE_CHECKING:
    from .frontdoor import FrontDoor

# How a replica's failure reaches a request: its engine's word, or its process gone.
REPLICA_FAILURES: tuple[type[BaseException], ...] = (ReplicaDeadError, ReplicaLostError)


class Stream:
    """One request's deltas, the first already received; iterate once, or ``aclose``."""

    def __init__(
        self,
        door: FrontDoor,
        request_id: str,
        replica: str,
        first: GenerateDelta,
        rest: AsyncIterator[GenerateDelta],
        fingerprint: str = "",
    ) -> None:
        self.door, self.request_id, self.replica = door, request_id, replica
        self.fingerprint = fingerprint
        self.tenant: str | None = None  # set by FrontDoor.open: its share, released at close
        self._first: GenerateDelta | None = first
        self.num_output_tokens = 0  # as the replica counts them (cumulative)
        self._rest = rest
        self._done = False
        self._itl: Any = None  # this stream's inter-token histogram, once labelled
        self._last_at = time.perf_counter()  # of the latest delta with tokens (first: now)

    def _timed(self, delta: GenerateDelta) -> None:
        """Inter-token latency: the gap since the previous delta, per token of this one."""
        n = len(delta.delta_token_ids)
        if not n:
            return
        now = time.perf_counter()
        if self._itl is None:
            m = self.door.metrics
            self._itl = m.itl.labels(m.tenant(self.tenant), self.replica)
        self._itl.observe((now - self._last_at) / n)
        self._last_at = now

    @property
    def first(self) -> GenerateDelta | None:
        """The first delta, until iteration hands it out."""
        return self._first

    async def __aiter__(self) -> AsyncIterator[GenerateDelta]:
        try:
            if self._first is not None:
                first, self._first = self._first, None
                self.num_output_tokens = first.num_output_tokens
                yield first
                if first.finished:
                    return
            async for delta in self._rest:
                self.num_output_tokens = delta.num_output_tokens
                self._timed(delta)
                yield delta
                if delta.finished:
                    return
        except REPLICA_FAILURES as exc:
            door = self.door
            if getattr(exc, "suspect", False):  # its engine died computing it: no replay
                door.suspects.strike(self.fingerprint, self.request_id, self.replica, strikes=2)
            elif getattr(exc, "maybe_cause", False):  # its process died, it the likeliest
                strikes = 2 if exc.alone else 1  # type: ignore[attr-defined]
                door.suspects.strike(self.fingerprint, self.request_id, self.replica, strikes)
            raise  # the failover already dropped the replica that failed (maybe not ours)
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Ends the request (cancelling it on the replica if it still runs); idempotent."""
        if self._done:
            return
        self._done = True
        with contextlib.suppress(Exception):
            await self._rest.aclose()  # type: ignore[attr-defined]
        self.door.policy.on_finished(self.request_id, time.monotonic(), self.num_output_tokens)
        self.door.wake()
        if self.tenant is not None:
            self.door.shares.release(self.tenant)
            self.door.rates.charge(self.tenant, self.num_output_tokens)
