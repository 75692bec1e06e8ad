"""Admission: who may start a request now -- before its body is read.

Why before the body: a refused request should cost the front door a header lookup, not a
body read, a validation and a tokenization. A tenant flooding past its concurrency limit
is therefore refused (429, ``Retry-After``) the moment its key is known, and a request
that must wait for a slot waits before it is parsed. The prompt's tokens are charged to
the tenant's tokens-per-minute bucket once they are known (:meth:`Admission.charge`); a
tenant in debt is refused at the door, as before.

The order of the checks: the tenant's share of the budget (its own ``max_concurrent`` or
the router's per-tenant cap), then the router's budget (``max_in_flight``; past it a
bounded, timed FIFO queue absorbs a burst), then the tenant's rates. A refusal by any
changes nothing.

Invariants: ``in_flight`` equals the tickets handed out and not released; each ticket is
released once, however its request ends (``release`` is idempotent); a tenant's share
count equals its unreleased tickets.
"""

from __future__ import annotations

from collections import Counter

from .limits import AdmissionQueue, OverloadedError, RateLimits, TenantShares
from .tenants import Tenant

__all__ = ["Admission", "OverloadedError", "Ticket"]


class Ticket:
    """One admitted request's hold on the budgets, given back by :meth:`Admission.release`."""

    __slots__ = ("released", "tenant_id")

    def __init__(self, tenant_id: str) -> None:
        self.tenant_id = tenant_id
        self.released = False


class Admission:
    """The router's in-flight budget with its waiters, and each tenant's limits."""

    def __init__(
        self,
        max_in_flight: int | None = None,
        max_in_flight_per_tenant: int | None = None,
        queue: int | None = None,
        timeout_s: float = 2.0,
    ) -> None:
        """``max_in_flight``: requests admitted at once (None: no limit); more wait in a
        queue of ``queue`` (default: ``max_in_flight``) for up to ``timeout_s``, and past
        that are refused. ``max_in_flight_per_tenant``: what one tenant may hold, waiting
        or running (None: no own cap; a tenant's ``max_concurrent`` replaces it)."""
        self.max_in_flight = max_in_flight
        self.shares = TenantShares(max_in_flight_per_tenant)
        self.rates = RateLimits()
        self.queue = AdmissionQueue(queue if queue is not None else (max_in_flight or 0), timeout_s)
        self.errors: Counter[str] = Counter()  # its refusals (the front door sums the parts')
        self.in_flight = 0

    def _has_room(self) -> bool:
        """Room in the budget, counting slots handed to waiters that have not yet run."""
        budget = self.max_in_flight
        return budget is None or self.in_flight + self.queue.reserved < budget

    async def admit(self, tenant: Tenant) -> Ticket:
        """A ticket for one request of ``tenant``, or :class:`OverloadedError` (a 429)."""
        tid = tenant.tenant_id
        if not self.shares.admit(tid, tenant.limits):
            self.errors["tenant_overloaded"] += 1
            cap = self.shares.cap_for(tenant.limits)
            raise OverloadedError(
                f"this tenant already has {cap} requests in flight; retry shortly"
            )
        try:
            if self.max_in_flight is not None:
                try:
                    await self.queue.wait(self._has_room, self.max_in_flight)
                except OverloadedError:
                    self.errors["overloaded"] += 1
                    raise
            self.in_flight += 1  # in this tick: the slot the queue reserved is taken now
            try:
                self.rates.admit(tid, tenant.limits, 0)
            except OverloadedError:
                self.in_flight -= 1
                self.errors["tenant_rate_limited"] += 1
                raise
        except BaseException:
            self.shares.release(tid)
            self.queue.wake(self._has_room)
            raise
        return Ticket(tid)

    def concurrency_cap(self, tenant: Tenant) -> int | None:
        """The most requests ``tenant`` can ever hold at once (None: no bound): a request
        needing more (several choices) could never be admitted, whatever it waits."""
        caps = [c for c in (self.shares.cap_for(tenant.limits), self.max_in_flight) if c]
        return min(caps) if caps else None

    def charge(self, ticket: Ticket, tokens: int) -> None:
        """Tokens of the ticket's request (its prompt once known, its output at the end)
        against its tenant's tokens per minute."""
        self.rates.charge(ticket.tenant_id, tokens)

    def release(self, ticket: Ticket, output_tokens: int = 0) -> None:
        """The request ended: its slot goes to the oldest waiter. Idempotent."""
        if ticket.released:
            return
        ticket.released = True
        self.in_flight -= 1
        self.shares.release(ticket.tenant_id)
        self.charge(ticket, output_tokens)
        self.queue.wake(self._has_room)

    def resize(
        self, max_in_flight: int | None, max_in_flight_per_tenant: int | None, queue: int
    ) -> None:
        """New limits (the fleet grew or shrank; see :meth:`__init__`). Requests already
        admitted stay; a larger budget hands its room to the waiters now."""
        self.max_in_flight = max_in_flight
        self.shares.cap = max_in_flight_per_tenant
        self.queue.max_waiting = queue
        self.queue.wake(self._has_room)

    def tenant_in_flight(self, tenant_id: str) -> int:
        return self.shares.in_flight(tenant_id)

    @property
    def waiting(self) -> int:
        return self.queue.waiting
