"""RequestRun: one request from routing to its end -- routed, streaming, failing over, done.

Why one object: a request holds shared resources from admission to its end -- its
:class:`~.admission.Ticket` (the tenant's share and rates, a slot in the router's budget),
its flight on a replica's connection, its place in the policy's load view -- and every way
it can end (finished, client gone, replica failed, cancelled) must give them back exactly
once. :meth:`RequestRun.close` is that one place, and it is synchronous: nothing can
interrupt it halfway.

Why no generator chain: per streamed token the front door does little, so the layers
around it are the cost. :meth:`RequestRun.next` awaits the replica connection's
:class:`~.replica_connection.InFlightRequest` directly (deltas that arrived while the caller
was busy come merged), and the HTTP layer awaits it directly: one wake-up per delta, no
async generator in between. Once a stream is under way even that wake-up goes:
:meth:`RequestRun.stream_to` hands each delta that arrives while the stream waits straight
to its socket, from the connection's callback, as long as the client keeps up.

Failures: a replica that fails is dropped from routing (:meth:`Fleet.fail`). The request
goes on once on another replica -- from scratch before its first token, from the tokens
already streamed after it (:class:`Resume`; greedy and seeded requests continue exactly)
-- but only when the failure cannot have been its own doing (:func:`not_caused_by`).
Otherwise it may be a query of death: it is struck in :mod:`.quarantine` and the failure
raised. So exactly one request per process death fails, and none is replayed blindly.

Why :class:`RunServices` and not the front door: a run needs a few of the front door's
parts -- some of the fleet's methods (:class:`Replicas`), the policy, the quarantine,
admission's release, the counters -- and is handed exactly those, once per front door, so
what a run can touch is read here and a run can be built without a front door.

Where a request goes next: :mod:`.responses` reads its deltas (``first_delta``, ``next``,
``stream_to``) and ends it (``close``); nothing here calls back up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from kvroute.events.kv_transfer import KVSource
from kvroute.events.replica_api import (
    GenerateDelta,
    GenerateRequest,
    InvalidRequestError,
    ReplicaDeadError,
    ReplicaLostError,
    Resume,
    delta_error,
)

from ..routing.disagg import plan, route_decode
from ..routing.policy import Decision, NoReplicaError, Policy, RequestView
from .bands import Waiter
from .flow import MAX_CHARGED_OUTPUT, FlowControl, Queued
from .quarantine import Quarantine, fingerprint, not_caused_by

if TYPE_CHECKING:
    from ..api.metrics import Metrics
    from ..backends.connection import HttpReplicaConnection
    from .admission import Ticket
    from .replica_connection import InFlightRequest, ReplicaConnection

log = logging.getLogger(__name__)

# How a replica's failure reaches a request: its engine's word, or its process gone.
REPLICA_FAILURES: tuple[type[BaseException], ...] = (ReplicaDeadError, ReplicaLostError)
MAX_RESENDS = 1  # another replica gets a request at most this often


class Replicas(Protocol):
    """What a run needs of the fleet (:class:`~.fleet.Fleet` is one)."""

    @property
    def split_roles(self) -> bool: ...  # some replica prefills or decodes only (P/D)

    def routable(self, exclude: Collection[str] = ()) -> list[str]: ...

    def connection(self, rid: str) -> ReplicaConnection | HttpReplicaConnection: ...

    def fail(self, rid: str) -> None: ...

    def mark_routed(self, rid: str) -> None: ...

    def role(self, rid: str) -> str: ...

    def fetch_endpoint(self, rid: str) -> str: ...


@dataclass(frozen=True, slots=True)
class RunServices:
    """What every run of one front door shares, made once by the front door."""

    replicas: Replicas
    policy: Policy
    quarantine: Quarantine
    release: Callable[[Ticket, int], None]  # admission's: the run's ticket back, once
    metrics: Metrics  # routing decisions, inter-token latency
    counters: Counter[str]  # requests, retries, failovers
    errors: Counter[str]  # no_replica, invalid_request
    pd_priced: bool = True  # P/D: split only where it pays (routing/disagg.py); else always
    pd_pair: bool = False  # P/D on a fleet of both: a request may split between any two
    flow: FlowControl | None = None  # the front door's queue (None: every run sent at once)

    def route(self, view: RequestView, candidates: list[str], now: float) -> Decision:
        """The policy's choice, counted in /metrics with its reason."""
        decision = self.policy.route(view, candidates, now)
        self.metrics.routing.labels(decision.replica, decision.reason).inc()
        return decision


class RequestRun:
    """One routed request. ``start`` once, then ``next`` until a finished delta, then (or
    whenever it must end) ``close``."""

    def __init__(
        self,
        services: RunServices,
        ticket: Ticket,
        view: RequestView,
        request: GenerateRequest,
        fingerprint: str | None = None,
        adapter: tuple[str, str] | None = None,
    ) -> None:
        """``fingerprint``: the request's, when already computed (else made on demand);
        ``adapter``: its LoRA adapter's (name, folder), part of the fingerprint."""
        self.services = services
        self.ticket = ticket
        self.view = view
        self.request = request
        self._fingerprint = fingerprint
        self._adapter = adapter
        self.request_id = view.request_id
        self.tenant = ticket.tenant_id
        self.replica = ""  # where it runs now
        self.num_output_tokens = 0  # as the replica counts them (cumulative)
        self.first: GenerateDelta | None = None
        self._tried: set[str] = set()
        self._resends = 0
        self._sends = 0  # sends so far: each after the first has an id of its own
        self._source: KVSource | None = None  # the lease a handed-off request pulls from
        self._handed_off = False  # its prefill part is done: the rest goes to a decoder
        # Pairs (routing/disagg.py, plan(pair=True)): the decode replica the price chose for
        # its split, and whether the next send is that decode part (not a later failover).
        self._decode_to: str | None = None
        self._pair_decode = False
        self._conn: ReplicaConnection | None = None
        self._flight: InFlightRequest | None = None
        self._output_ids: list[int] = []  # streamed so far: what a failover resumes from
        self._sent_chars = 0
        self._awaiting_first = True  # of the current replica (the policy times it)
        self._itl: Any = None  # this run's inter-token histogram, once labelled
        self._last_at = 0.0
        self._closed = False
        self._writer: Callable[[GenerateDelta], bool] | None = None  # see stream_to
        self._waiter: Waiter | None = None  # its place in the flow queue, while it waits
        self._room: list[str] | None = None  # at dispatch: the replicas with room
        self._slot: str | None = None  # the replica whose flow slot it holds

    @property
    def fingerprint(self) -> str:
        """What the quarantine knows the request by (computed only when it is needed)."""
        if self._fingerprint is None:
            req = self.request
            self._fingerprint = fingerprint(
                req.prompt_token_ids, req.sampling, req.tenant, self._adapter
            )
        return self._fingerprint

    @property
    def waiting(self) -> bool:
        """It waits at the door for a replica with room (flow control)."""
        return self._waiter is not None

    # -- routing -------------------------------------------------------------------------------
    def _send(self) -> None:
        """Routes the request among the replicas it has not tried and sends it there."""
        s = self.services
        candidates = s.replicas.routable(self._tried)
        room = self._room
        if room is not None:  # dispatched by flow control: among those with room
            candidates = [c for c in candidates if c in room] or candidates
        if not candidates:
            s.errors["no_replica"] += 1
            lora = self.view.lora_name
            if lora is None:
                raise NoReplicaError("no replica is available")
            # Only replicas holding the adapter are candidates (router/lora/registry.py).
            raise NoReplicaError(
                f"No replica that holds the LoRA adapter `{lora[:100]}` is available; "
                "retry later.", "lora_adapter_unavailable", "model",
            )  # fmt: skip
        # P/D (routing/disagg.py): its prefill on a prefill replica, which hands off after
        # the first token; then the rest on a replica that decodes, pulling the prompt's KV.
        now = time.monotonic()
        part = None  # a unified fleet without pairs: one pass, nothing to plan
        if s.pd_pair or s.replicas.split_roles:
            part = plan(
                self.request,
                candidates,
                s.replicas.role,
                decoding=bool(self._output_ids) or self._handed_off,
                view=self.view,
                policy=s.policy if s.pd_priced else None,
                now=now,
                pair=s.pd_pair,
            )
            if part.handoff:
                self._decode_to = part.decode
        if self._pair_decode:
            decision = self._route_pair_decode(candidates, now)
        else:
            decision = s.route(self.view, candidates if part is None else part.candidates, now)
        rid = decision.replica
        self._tried.add(rid)
        req = self.request
        self._sends += 1
        if self._sends > 1:  # a fresh id: the old replica may still know the old one
            resume = None
            if self._output_ids:
                resume = Resume(
                    output_token_ids=list(self._output_ids), sent_chars=self._sent_chars
                )
            req = msgspec.structs.replace(
                req, request_id=f"{req.request_id}-{self._sends - 1}", resume=resume
            )
        if decision.fetch_from is not None and self._source is None:
            self._source = self._fetch_source(decision.fetch_from, decision.fetch_blocks)
        handoff = part is not None and part.handoff
        if handoff or self._source is not None:
            req = msgspec.structs.replace(req, kv_handoff=handoff, kv_source=self._source)
            self._source = None  # one pull per lease
        self.replica = rid
        self._awaiting_first = True
        if s.flow is not None:
            self._vacate()
            s.flow.occupy(rid, self.view.num_prompt_tokens, self.request.priority, self.tenant)
            self._slot = rid
        self._conn = s.replicas.connection(rid)
        self._flight = self._conn.submit(req)
        if self._writer is not None:
            self._flight.push = self._push

    def _route_pair_decode(self, candidates: list[str], now: float) -> Decision:
        """A pair's decode part: to the replica its price chose, else to any but the one
        that computed its prompt (while another is routable); booked as what it computes
        there, the tail past the blocks it pulls (disagg.route_decode)."""
        self._pair_decode = False
        chosen = self._decode_to
        if chosen is not None and chosen in candidates:
            candidates = [chosen]
        elif len(candidates) > 1:
            candidates = [c for c in candidates if c != self.replica] or candidates
        lease = self._source.num_blocks * self.view.block_size if self._source else 0
        s = self.services
        decision = route_decode(s.policy, self.view, candidates, now, lease)
        s.metrics.routing.labels(decision.replica, decision.reason).inc()
        return decision

    def _fetch_source(self, holder: str, num_blocks: int) -> KVSource | None:
        """A prefix fetch (routing/fetch.py): the blocks are named by hash, no lease."""
        endpoint = self.services.replicas.fetch_endpoint(holder)
        if not endpoint:  # gone since the policy looked: the replica computes them
            return None
        return KVSource(replica_id=holder, endpoint=endpoint, lease=b"", num_blocks=num_blocks)

    async def start(self) -> GenerateDelta:
        """Routes the request and waits for its first delta, so that everything that can go
        wrong before it (a bad request, a dead replica) is settled while an HTTP status can
        still say so. Raises :class:`InvalidRequestError` (the client's fault),
        :class:`NoReplicaError`, or the replica's failure when it was not retried."""
        self.submit()
        return await self.first_delta()

    def submit(self, deadline: float | None = None) -> None:
        """The first half of :meth:`start`: routed and sent (raises
        :class:`NoReplicaError`), so the caller can get ready while the replica computes.
        Under flow control it may wait at the door instead (its first delta waits for its
        dispatch), or be refused (:class:`~.flow.ShedError`); ``deadline``: the monotonic
        time its first token is due by (a request still waiting then is refused)."""
        s = self.services
        s.counters["requests"] += 1
        if s.flow is None:
            self._send()
            return
        view = self.view
        waiter = Waiter(
            band=self.request.priority,
            tenant=self.tenant,
            cost=view.num_prompt_tokens + min(view.max_tokens or 0, MAX_CHARGED_OUTPUT),
            dispatch=self._dispatch,
            eligible=partial(s.replicas.routable, self._tried),
            deadline=deadline,
        )
        room = s.flow.enter(waiter)
        if isinstance(room, Queued):  # its dispatch is called when its turn comes
            self._waiter = waiter
        else:
            self._dispatch(room)

    def _dispatch(self, room: list[str] | None) -> None:
        """Flow control's call: route among ``room`` (None: any) and send, now."""
        self._waiter = None
        self._room = room
        try:
            self._send()
        finally:
            self._room = None

    async def _dispatched(self) -> None:
        """Waits for the run's turn at the door (what its send raised, raised here). A
        cancelled wait (the client left) takes it out of the queue."""
        waiter = self._waiter
        assert waiter is not None and waiter.future is not None
        try:
            await waiter.future
        except asyncio.CancelledError:
            flow = self.services.flow
            if flow is not None:
                flow.cancel(waiter)
            raise
        finally:
            self._waiter = None

    def _vacate(self) -> None:
        """Gives back its flow slot (first token, failure, end): room for the next."""
        slot, flow = self._slot, self.services.flow
        if slot is not None and flow is not None:
            self._slot = None
            flow.vacate(slot, self.view.num_prompt_tokens, self.request.priority, self.tenant)

    async def first_delta(self) -> GenerateDelta:
        """The second half of :meth:`start`."""
        first = await self.next()
        self.first = first
        return first

    # -- streaming ---------------------------------------------------------------------------
    async def next(self) -> GenerateDelta:
        """The deltas since the last call, merged; the last one is ``finished``. A failure
        of the replica is failed over when it may be, else raised."""
        if self._waiter is not None:
            await self._dispatched()
        while True:
            flight = self._flight
            assert flight is not None, "start() first"
            try:
                delta = await flight.next()
                if delta.failure is not None:  # checked here: most deltas carry none
                    exc = delta_error(delta, self.replica)
                    if exc is not None:
                        raise exc
            except REPLICA_FAILURES as exc:
                self._conn = self._flight = None
                self._vacate()
                if not self._fail_over(exc):
                    raise
                continue
            except InvalidRequestError:
                self._flight = None
                self._vacate()
                self.services.errors["invalid_request"] += 1
                raise
            if delta.finish_reason == "handoff":
                plain = self._hand_off(delta)
                if plain is None:  # vLLM's handoff: the decode replica makes the first token
                    continue
                return plain
            self._record_delta(delta)
            return delta

    def _hand_off(self, delta: GenerateDelta) -> GenerateDelta | None:
        """The prefill replica made the first token and leased the prompt's blocks: the
        client gets the token as any, and the request goes on on a decode replica. None: a
        handoff without a token (vLLM's ``kv_transfer_params``: the decode side makes it)."""
        handoff = delta.kv_handoff
        plain = msgspec.structs.replace(delta, finished=False, finish_reason=None, kv_handoff=None)
        if plain.delta_token_ids:
            self._record_delta(plain)
        self._handed_off = True
        s = self.services
        s.counters["handoffs"] += 1
        # its prefill part ends; None: one token is no output length to learn from
        s.policy.on_finished(self.request_id, time.monotonic(), None)
        if handoff is not None and handoff.num_blocks:
            self._source = KVSource.of(handoff)
        # The prefill replica did its part without failing: a failover of the decode may
        # go there (the only replica left that can take it, in a 1 + 1 fleet).
        self._tried.discard(self.replica)
        self._pair_decode = self.services.pd_pair
        self._conn = self._flight = None
        self._send()
        return plain if plain.delta_token_ids else None

    def stream_to(self, writer: Callable[[GenerateDelta], bool]) -> None:
        """From now on, a delta that arrives while :meth:`next` waits goes to ``writer`` at
        once, on the connection's callback, if it takes it (True): no task wakes and no
        future is made per token while the client keeps up. The rest (the last delta,
        failures, deltas ``writer`` refuses) still come out of :meth:`next`, in order."""
        self._writer = writer
        if self._flight is not None:
            self._flight.push = self._push

    def _push(self, delta: GenerateDelta) -> bool:
        writer = self._writer
        if writer is None:
            return False
        try:
            if not writer(delta):
                return False
        except Exception:  # on the connection's callback: never let it raise there
            log.exception("request %s: a delta failed on the direct path", self.request_id)
            self._writer = None
            return False
        self._record_delta(delta)
        return True

    def _record_delta(self, delta: GenerateDelta) -> None:
        """Bookkeeping per delta: what a failover resumes from, the policy's first-token
        time, inter-token latency for /metrics."""
        ids = delta.delta_token_ids
        self._output_ids += ids
        self._sent_chars += len(delta.delta_text)
        self.num_output_tokens = delta.num_output_tokens
        if delta.finished:
            self._flight = None  # the connection forgot it already
        now = time.perf_counter()
        if self._awaiting_first:
            self._awaiting_first = False
            self.services.policy.on_first_token(self.request_id, time.monotonic())
            self.services.replicas.mark_routed(self.replica)
            self._vacate()
        elif ids:
            if self._itl is None:
                m = self.services.metrics
                self._itl = m.itl.labels(m.tenant(self.tenant), self.replica)
            self._itl.observe((now - self._last_at) / len(ids))
        if ids:
            self._last_at = now

    def _fail_over(self, exc: BaseException) -> bool:
        """The replica failed under this request: drop it, and resend the request when the
        failure cannot have been its doing and it has a resend left (True). Else strike it
        when it may have been (False: the caller raises)."""
        s = self.services
        failed = self.replica
        s.replicas.fail(failed)
        innocent = not_caused_by(exc)
        if innocent is not True:
            strikes = 2 if innocent is None or getattr(exc, "alone", False) else 1
            s.quarantine.strike(self.fingerprint, self.request_id, failed, strikes)
            return False
        if self._resends >= MAX_RESENDS or not s.replicas.routable(self._tried):
            return False
        s.policy.on_finished(self.request_id, time.monotonic())
        self._resends += 1
        self._send()
        if self._output_ids or self.first is not None:
            s.counters["failovers"] += 1
            log.warning(
                "request %s: replica %s failed after %d tokens; continuing on %s",
                self.request_id, failed, len(self._output_ids), self.replica,
            )  # fmt: skip
        else:
            s.counters["retries"] += 1
            log.warning("request %s: replica %s failed, retrying on %s",
                        self.request_id, failed, self.replica)  # fmt: skip
        return True

    # -- the end -------------------------------------------------------------------------------
    def close(self) -> None:
        """Ends the request: cancels it on its replica if it still runs, gives back its
        ticket and its place in the load view. Idempotent, synchronous."""
        if self._closed:
            return
        self._closed = True
        self._writer = None
        flow = self.services.flow
        waiter = self._waiter
        if waiter is not None and flow is not None:
            flow.cancel(waiter)
            self._waiter = None
            fut = waiter.future  # a send that failed unawaited: its failure is read here
            if fut is not None and fut.done() and not fut.cancelled():
                fut.exception()
        if self._flight is not None and self._conn is not None:
            self._conn.abort(self._flight.request_id)
            self._flight = None
        self._vacate()
        s = self.services
        s.policy.on_finished(self.request_id, time.monotonic(), self.num_output_tokens)
        s.release(self.ticket, self.num_output_tokens)
