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

The tenant's limits (:class:`~.tenants.Limits`, here since they are admission's own
checks: one module on a request's path, not two). Why these three: concurrency bounds what
one tenant holds of the fleet at an instant (an admitted stream cannot be taken back);
requests per minute bound its arrival rate; tokens per minute bound the work it asks for,
prompt and output alike (OpenAI's ``TPM``). Over any of them the answer is 429 with
``Retry-After``: the seconds until the limit would admit the request, so a well-behaved
client backs off exactly as long as it must.

Rates are token buckets (capacity one minute's allowance, refilled continuously), so a
tenant may burst up to its minute's allowance and no further. The token bucket goes into
debt: a request is admitted while the bucket is positive and its prompt is charged at
once, its output when it ends (the output is not known before); a tenant in debt waits
until the refill has paid it off. Limits are per front-door process: with ``--routers N``
a tenant may get up to N times each rate (connections spread over the processes).

Invariants: ``in_flight`` equals the tickets handed out and not released; each ticket is
released once, however its request ends (``release`` is idempotent); a tenant's share
count equals its unreleased tickets (its successful :meth:`TenantShares.admit` calls
minus its :meth:`~TenantShares.release` calls); a bucket's level never exceeds its
capacity; a refused request changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter, deque
from collections.abc import Callable

from .tenants import Limits, Tenant

__all__ = ["Admission", "AdmissionQueue", "OverloadedError", "RateLimits", "TenantShares", "Ticket"]


class OverloadedError(RuntimeError):
    """The router's in-flight budget or one of the tenant's limits refuses a request
    (HTTP 429, ``Retry-After``: :attr:`retry_after`)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def retry_after(self) -> str:
        """The ``Retry-After`` header: whole seconds, at least 1."""
        return str(max(1, math.ceil(self.retry_after_s)))


class TokenBucket:
    """``per_minute`` units a minute, at most one minute's worth banked."""

    __slots__ = ("capacity", "level", "rate", "updated")

    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.updated = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_s(self, need: float, now: float) -> float:
        """Seconds until the level reaches ``need`` (0: it already has)."""
        self.refill(now)
        return max(0.0, (need - self.level) / self.rate)


class TenantShares:
    """Each tenant's share of a router's in-flight budget: at most its cap at once.

    Why a fixed cap and not a share that grows while a tenant is alone: an admitted stream
    cannot be taken back, so a tenant that filled the whole budget while alone would leave
    a newcomer nothing until its streams ended. A cap below the router's budget (``kvroute
    serve``: half of it when two tenants or more are configured) always leaves the others
    room. A tenant's own ``max_concurrent`` replaces the default cap. One counter per
    tenant with requests in flight: O(1) per request.
    """

    def __init__(self, cap: int | None = None) -> None:
        """``cap``: requests a tenant without its own limit may hold at once (None: no cap)."""
        if cap is not None and cap < 1:
            raise ValueError(f"a tenant's in-flight cap must be >= 1, got {cap}")
        self.cap = cap
        self._counts: Counter[str] = Counter()

    def cap_for(self, limits: Limits | None) -> int | None:
        own = limits.max_concurrent if limits is not None else None
        return own if own is not None else self.cap

    def admit(self, tenant_id: str, limits: Limits | None = None) -> bool:
        """Counts one more request of the tenant in flight; False (nothing counted) when
        the tenant already holds its cap."""
        cap = self.cap_for(limits)
        if cap is not None and self._counts[tenant_id] >= cap:
            return False
        self._counts[tenant_id] += 1
        return True

    def release(self, tenant_id: str) -> None:
        """One of the tenant's requests ended (once per successful :meth:`admit`)."""
        n = self._counts[tenant_id] - 1
        if n > 0:
            self._counts[tenant_id] = n
        else:  # no entry kept for a tenant with nothing in flight
            self._counts.pop(tenant_id, None)

    def in_flight(self, tenant_id: str) -> int:
        return self._counts.get(tenant_id, 0)


class RateLimits:
    """Requests and tokens per minute, per tenant (buckets made at a tenant's first
    request, only for the limits it has)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}

    def _bucket(
        self, table: dict[str, TokenBucket], tenant_id: str, per_minute: int | None, now: float
    ) -> TokenBucket | None:
        if per_minute is None:
            return None
        b = table.get(tenant_id)
        if b is None or b.capacity != per_minute:  # new, or the limit changed
            b = table[tenant_id] = TokenBucket(per_minute, now)
        return b

    def admit(self, tenant_id: str, limits: Limits, prompt_tokens: int) -> None:
        """Takes one request and charges the prompt, or raises :class:`OverloadedError`
        (nothing taken) with the seconds until the request would be admitted."""
        now = self._clock()
        req = self._bucket(self._requests, tenant_id, limits.requests_per_minute, now)
        tok = self._bucket(self._tokens, tenant_id, limits.tokens_per_minute, now)
        wait_req = req.wait_s(1.0, now) if req is not None else 0.0
        # In debt (level <= 0) the tenant waits until the level is positive again.
        wait_tok = tok.wait_s(1e-9, now) if tok is not None else 0.0
        if wait_req > 0 or wait_tok > 0:
            which = (
                f"{limits.requests_per_minute} requests per minute"
                if wait_req >= wait_tok
                else f"{limits.tokens_per_minute} tokens per minute"
            )
            raise OverloadedError(
                f"this tenant's limit of {which} is reached", max(wait_req, wait_tok)
            )
        if req is not None:
            req.level -= 1.0
        if tok is not None:
            tok.level -= prompt_tokens

    def levels(self, tenant_id: str) -> tuple[float | None, float | None]:
        """What is left in the tenant's request and token buckets as last charged (None:
        no such limit, or no request yet): what /metrics and tests can read."""
        req, tok = self._requests.get(tenant_id), self._tokens.get(tenant_id)
        return (
            req.level if req is not None else None,
            tok.level if tok is not None else None,
        )

    def charge(self, tenant_id: str, tokens: int) -> None:
        """Output tokens of a finished request (the bucket may go into debt)."""
        tok = self._tokens.get(tenant_id)
        if tok is not None and tokens > 0:
            tok.refill(self._clock())
            tok.level -= tokens


class AdmissionQueue:
    """Requests past a router's in-flight budget wait here, first come first served -- at
    most ``max_waiting`` of them, each for at most ``timeout_s`` -- so a burst is absorbed
    rather than refused; past either bound, 429.

    Why reservations: a freed slot is handed to the oldest waiter, and until it runs it
    holds the slot (``reserved``), so a request that arrives meanwhile cannot take it: the
    room test is ``in flight + reserved < budget``, and a newcomer queues whenever anyone
    waits. Everything runs on the event loop: no locks.
    """

    def __init__(self, max_waiting: int, timeout_s: float) -> None:
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.reserved = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def wait(self, has_room: Callable[[], bool], budget: int) -> None:
        """Returns once the request may go (at once when there is room and no queue), or
        raises :class:`OverloadedError`. ``has_room`` counts ``reserved`` in."""
        if not self._waiters and has_room():
            return
        if len(self._waiters) >= self.max_waiting:
            raise OverloadedError(
                f"{budget} requests in flight and {len(self._waiters)} waiting; retry shortly"
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(fut, self.timeout_s)
        except BaseException as exc:
            if fut.done() and not fut.cancelled():  # granted as it gave up: pass the slot on
                self.reserved -= 1
                self.wake(has_room)
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(fut)
            if isinstance(exc, TimeoutError):
                raise OverloadedError(
                    f"{budget} requests in flight; waited {self.timeout_s:g} s for a slot; "
                    "retry shortly"
                ) from None
            raise
        self.reserved -= 1  # it goes now: the caller counts it in flight before any await

    def wake(self, has_room: Callable[[], bool]) -> None:
        """Hands free slots to the oldest waiters (call when a request ends)."""
        while self._waiters and has_room():
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                self.reserved += 1


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
