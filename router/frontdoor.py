"""FrontDoor: the router's runtime -- replicas, their event streams, the index, the policy.

One object per router process, used from one asyncio loop (the HTTP server's). The event
subscriber runs on its own thread and feeds :class:`PrefixIndex` (which locks); everything
else (policy, load, counters) is touched only from the loop.

Why the shape:
- The fleet's :class:`BlockHasher` comes from the replicas' own :class:`ReplicaInfo`, and a
  replica whose hash config or model disagrees with the fleet is refused: a router hashing
  differently from its engines silently gets 0% hits (DESIGN, "Facts worth knowing").
- Requests and deltas travel on the data plane (:mod:`.dataplane`, ZeroMQ, one message per
  replica step), never through Ray; Ray is discovery, restarts and load reports.
- :meth:`open` routes and waits for the first delta before returning, so everything that can
  go wrong before the first token (a bad request, a dead replica) is settled while the HTTP
  status can still say so; a replica that fails then is dropped and the request retried
  once elsewhere, but only when the failure cannot have been the request's doing: the
  engine says the request was not in the failing step, or its process died and another
  request is the one held answerable. Otherwise it may be a query of death, which
  :mod:`.quarantine` refuses rather than replays: exactly one request per process death.
- Mid-stream failover: a replica that fails after a request's first token, for a reason
  that cannot have been the request's (the same rule), is replaced once: the prompt and
  the tokens already streamed go to another replica (``GenerateRequest.resume``), which
  continues exactly (greedy and seeded alike), so the client sees one stream.
- Admission: the tenant's own share of the router's budget, then the budget itself
  (``max_in_flight``; past it a bounded, timed FIFO queue absorbs a burst), then the
  tenant's rates (:mod:`.limits`); a 429 with ``Retry-After`` past any, so one tenant's
  burst is refused while others are still admitted.
- Replicas restart with new ports (Ray ``max_restarts``): a monitor polls ``info()`` and,
  on a new incarnation, drops what the index knew and follows the new endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvroute.events import BlockHasher, HashConfig, ZmqEventSubscriber, to_external
from kvroute.events.replica_api import (
    GenerateDelta,
    GenerateRequest,
    InvalidRequestError,
    ReplicaInfo,
    Resume,
    SamplingParams,
)

from .dataplane import ReplicaConnection
from .index import PrefixIndex
from .limits import AdmissionQueue, OverloadedError, RateLimits, TenantShares
from .load import LoadTracker
from .metrics import FleetCollector, Metrics
from .policy import NoReplicaError, Policy, RequestView, make_policy
from .quarantine import Quarantine, fingerprint, not_caused_by
from .stream import REPLICA_FAILURES, Stream
from .tenants import Tenant

log = logging.getLogger(__name__)

# Summed into /metrics across a replica's subscriptions.
RETIRED_EVENT_FIELDS = ("delivered", "gaps", "malformed", "restarts", "resets")
ADDED_LATENCY_WINDOW = 4096  # the latest requests whose added latency /metrics summarizes


class FleetMismatchError(ValueError):
    """A replica that cannot join this router's fleet (hash config or model differ)."""


@dataclass(slots=True)
class ReplicaHandle:
    """A replica as the front door uses it: its actor (control), its data-plane connection,
    its info, whether it is routable."""

    info: ReplicaInfo
    actor: Any
    alive: bool = True
    routed: int = 0  # kept across the replica's restarts, like every counter here
    failures: int = 0  # times it was found failed (by a request, its connection, the monitor)
    restarts: int = 0  # new incarnations the front door followed
    conn: ReplicaConnection | None = None  # made on the event loop, at first use


class FrontDoor:
    """Replicas + event subscriber + prefix index + policy, for one router."""

    def __init__(
        self,
        replicas: Sequence[tuple[Any, ReplicaInfo]],
        *,
        policy: str = "kv",
        tokenizer: Any = None,
        monitor_interval_s: float = 2.0,
        load_interval_s: float = 0.2,
        max_in_flight: int | None = None,
        max_in_flight_per_tenant: int | None = None,
        admission_queue: int | None = None,
        admission_timeout_s: float = 2.0,
    ) -> None:
        """``max_in_flight``: requests this router admits at once (None: no limit); more
        wait in a queue of ``admission_queue`` (default: ``max_in_flight``) for up to
        ``admission_timeout_s``, and past that are refused (429), never queued without
        bound. ``max_in_flight_per_tenant``: requests one tenant may hold, waiting or
        running (None: no own cap; a tenant's ``max_concurrent`` replaces it)."""
        if not replicas:
            raise ValueError("a front door needs at least one replica")
        first = replicas[0][1]
        self.model = first.model
        self.model_path = first.model_path
        self.max_model_len = min(info.max_model_len for _, info in replicas)
        self.hash_config: HashConfig = first.hash_config
        self.hash_form = first.hash_form
        self.hasher = BlockHasher(self.hash_config.algo, self.hash_config.seed, first.block_size)
        self.index = PrefixIndex()
        self.load = LoadTracker()
        self.policy: Policy = make_policy(
            policy, index=self.index, block_size=first.block_size, load=self.load
        )
        self.replicas: dict[str, ReplicaHandle] = {}
        # This front door's name on every replica's data plane (outputs come back to it).
        self.client_id = f"fd-{uuid.uuid4().hex[:12]}"
        self.subscriber = ZmqEventSubscriber(self.index.on_batch)
        self.counters: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.added_latency: deque[float] = deque(maxlen=ADDED_LATENCY_WINDOW)
        self.metrics = Metrics()
        self.fleet_collector = FleetCollector(self)
        self.metrics.registry.register(self.fleet_collector)
        # Event-stream counters of subscriptions already closed (replica restarts, losses).
        self.retired_event_stats: dict[str, Counter[str]] = {}
        self.monitor_interval_s = monitor_interval_s
        self.load_interval_s = load_interval_s
        self.max_in_flight = max_in_flight
        self.shares = TenantShares(max_in_flight_per_tenant)
        self.rates = RateLimits()
        queue = admission_queue if admission_queue is not None else (max_in_flight or 0)
        self.admission = AdmissionQueue(queue, admission_timeout_s)
        self.cordoned: set[str] = set()
        # Requests that were computing when a replica failed (see the module docstring).
        self.suspects = Quarantine(self.errors)
        self._monitor: asyncio.Task[None] | None = None
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.tokenizer = tokenizer
        for actor, info in replicas:
            self.add_replica(actor, info)

    @classmethod
    async def connect(cls, actors: Sequence[Any], **kw: Any) -> FrontDoor:
        """Waits for every actor's ``info()`` (model loaded), then builds the front door."""
        infos = await asyncio.gather(*(a.info.remote() for a in actors))
        return cls(list(zip(actors, infos, strict=True)), **kw)

    # -- membership ------------------------------------------------------------------------
    def check(self, info: ReplicaInfo) -> None:
        """Raises :class:`FleetMismatchError` unless the replica hashes and serves as the
        fleet does."""
        why = self.hash_config.mismatch(info.hash_config)
        if why:
            raise FleetMismatchError(f"replica {info.replica_id}: hash config differs ({why})")
        if info.hash_form != self.hash_form:
            raise FleetMismatchError(
                f"replica {info.replica_id}: hash form {info.hash_form!r} != {self.hash_form!r}"
            )
        if info.model != self.model:
            raise FleetMismatchError(
                f"replica {info.replica_id}: model {info.model!r} != fleet's {self.model!r}"
            )

    def add_replica(self, actor: Any, info: ReplicaInfo) -> None:
        """Follows the replica's events (a snapshot first) and makes it routable."""
        self.check(info)
        rid = info.replica_id
        old = self.replicas.get(rid)
        if old is not None:
            self._forget(rid)
        rep = self.replicas[rid] = ReplicaHandle(info, actor)
        if old is not None:  # a restart: its counters go on from where they were
            rep.routed, rep.failures = old.routed, old.failures
            rep.restarts = old.restarts + (info.incarnation != old.info.incarnation)
        if info.cost is not None:  # priced in its own seconds; else the policy's reference
            self.load.register(rid, info.cost, info.num_blocks)
        self.subscriber.add_publisher(rid, info.events_endpoint, info.replay_endpoint, info.topic)
        log.info("replica %s (incarnation %s) added", rid, info.incarnation[:8])

    def connection(self, rep: ReplicaHandle) -> ReplicaConnection:
        """The replica's data-plane connection, made at first use (on the running loop)."""
        conn = rep.conn
        if conn is None or conn.lost is not None:
            info = rep.info
            conn = rep.conn = ReplicaConnection(
                info.replica_id,
                info.data_endpoint,
                info.incarnation,
                self.client_id,
                self._on_connection_lost,
            )
        return conn

    def _on_connection_lost(self, rid: str, why: str) -> None:
        self.errors["connection_lost"] += 1
        self.on_replica_failure(rid, by_request=False)

    def _forget(self, rid: str) -> None:
        """Its cache is gone or out of reach: unsubscribe and drop what the index held for it
        (whatever the policy: /metrics and any later policy read the same index)."""
        stats = self.subscriber.stats().get(rid)
        if stats is not None:  # a new subscription starts at zero: keep the totals
            total = self.retired_event_stats.setdefault(rid, Counter())
            total.update({f: getattr(stats, f) for f in RETIRED_EVENT_FIELDS})
            total["resets"] += 1  # its indexed state is dropped now, rebuilt when it is back
        with contextlib.suppress(RuntimeError):
            self.subscriber.remove_publisher(rid)
        rep = self.replicas.get(rid)
        if rep is not None and rep.conn is not None:  # its requests fail over now
            rep.conn.lose("dropped by the front door", notify=False)
        self.index.drop_replica(rid)
        self.policy.on_replica_removed(rid)  # its load (and kv's own index view)

    def on_replica_failure(self, rid: str, by_request: bool = True) -> None:
        """The replica failed: stop routing to it until the monitor sees it back.
        ``by_request``: a request's deltas said so (not its connection or the monitor)."""
        rep = self.replicas.get(rid)
        if rep is None or not rep.alive:
            return
        rep.alive = False
        rep.failures += 1
        self.errors["replica_failure"] += 1
        self._forget(rid)
        log.warning("replica %s failed; not routing to it until it is back", rid)

    def alive(self) -> list[str]:
        return [rid for rid, r in self.replicas.items() if r.alive]

    def cordon(self, rid: str, cordoned: bool = True) -> None:
        """Stop (or resume) routing new requests to a live replica, e.g. to drain it before
        maintenance; requests already there run to their end."""
        if rid not in self.replicas:
            raise KeyError(rid)
        (self.cordoned.add if cordoned else self.cordoned.discard)(rid)

    def start(self) -> None:
        """Connects to every replica's data plane and starts the monitor on the running loop."""
        for rep in self.replicas.values():
            if rep.alive:
                self.connection(rep)
        if self._monitor is None:
            self._monitor = asyncio.get_running_loop().create_task(self._watch())

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        for rep in self.replicas.values():
            if rep.conn is not None:
                rep.conn.close()
        self.subscriber.close()

    async def _watch(self) -> None:
        """Every ``load_interval_s``: each live replica's :class:`LoadReport` into the load
        view (the path the simulator's reports take too); every ``monitor_interval_s``:
        restarts and recoveries."""
        last_poll = time.monotonic()
        while True:
            await asyncio.sleep(min(self.load_interval_s, self.monitor_interval_s))
            now = time.monotonic()
            for rep in list(self.replicas.values()):
                if rep.alive and rep.conn is not None:
                    rep.conn.check_silence(now)
            await asyncio.gather(*(self._load_report(rid) for rid in self.alive()))
            if time.monotonic() - last_poll >= self.monitor_interval_s:
                last_poll = time.monotonic()
                await asyncio.gather(*(self._poll(rid) for rid in list(self.replicas)))

    async def _load_report(self, rid: str) -> None:
        rep = self.replicas.get(rid)
        if rep is None:
            return
        try:
            report = await asyncio.wait_for(rep.actor.load.remote(), self.monitor_interval_s)
        except Exception:  # a failing replica is the monitor's business, not the load view's
            self.errors["load_report_failed"] += 1
            return
        if rep.alive and self.replicas.get(rid) is rep:
            self.load.report(rid, report, time.monotonic())

    async def _poll(self, rid: str) -> None:
        rep = self.replicas[rid]
        try:
            info = await asyncio.wait_for(rep.actor.info.remote(), self.monitor_interval_s * 5)
        except Exception as exc:
            if rep.alive:
                log.warning("replica %s does not answer (%s)", rid, type(exc).__name__)
            self.on_replica_failure(rid, by_request=False)
            return
        if info.incarnation != rep.info.incarnation:
            log.warning("replica %s restarted: following its new endpoints", rid)
            try:
                self.add_replica(rep.actor, info)
            except FleetMismatchError as exc:
                log.error("%s", exc)
                self.on_replica_failure(rid, by_request=False)
        elif not rep.alive:
            # The same process answers info() even while its engine is dead (it exits a
            # moment later, so Ray restarts it): only a passing health check brings it back.
            try:
                await asyncio.wait_for(rep.actor.health.remote(), self.monitor_interval_s * 5)
            except Exception:
                return
            rep.alive = True  # the same process, healthy again (a transient failure)
            self.connection(rep)
            self.subscriber.add_publisher(
                rid, info.events_endpoint, info.replay_endpoint, info.topic
            )
            log.info("replica %s is back", rid)

    # -- requests ----------------------------------------------------------------------------
    def block_hashes(self, prompt_token_ids: Sequence[int], salt: str) -> list[Any]:
        form = self.hash_form
        hashes = self.hasher.hash_blocks(prompt_token_ids, cache_salt=salt)
        return [to_external(h, form) for h in hashes]  # type: ignore[arg-type]

    async def open(
        self,
        tenant: Tenant,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_salt: str | None = None,
        request_id: str | None = None,
    ) -> Stream:
        """Admits the request (the router's and the tenant's budget), routes it and waits
        for its first delta (see the module docstring).

        Raises :class:`InvalidRequestError` (the client's fault), :class:`OverloadedError`,
        :class:`NoReplicaError` (none alive), or the replica's failure when the retry failed
        too."""
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
                    await self.admission.wait(self._has_room, self.max_in_flight)
                except OverloadedError:
                    self.errors["overloaded"] += 1
                    raise
            try:  # from here to routing nothing awaits: the slot is taken in this tick
                self.rates.admit(tid, tenant.limits, len(prompt_token_ids))
            except OverloadedError:
                self.errors["tenant_rate_limited"] += 1
                raise
            stream = await self._open(tenant, prompt_token_ids, sampling, request_salt, request_id)
        except BaseException:
            self.shares.release(tid)
            self.wake()
            raise
        stream.tenant = tid  # its share is released when the stream closes
        return stream

    def _has_room(self) -> bool:
        """Room in the router's budget, counting slots handed to waiters not yet routed."""
        budget = self.max_in_flight
        return budget is None or self.load.in_flight() + self.admission.reserved < budget

    def wake(self) -> None:
        """A request ended (or never started): its slot goes to the oldest waiter."""
        self.admission.wake(self._has_room)

    async def _open(
        self,
        tenant: Tenant,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_salt: str | None,
        request_id: str | None,
    ) -> Stream:
        fp = fingerprint(prompt_token_ids, sampling)
        self.suspects.check(fp)
        request_id = request_id or uuid.uuid4().hex
        salt = tenant.salt_for(request_salt)
        view = RequestView(
            request_id=request_id,
            num_prompt_tokens=len(prompt_token_ids),
            block_hashes=self.block_hashes(prompt_token_ids, salt),
            block_size=self.hasher.block_size,
            token_ids=prompt_token_ids,
            max_tokens=sampling.max_tokens,
        )
        tried: set[str] = set()
        self.counters["requests"] += 1
        for attempt in range(2):
            candidates = [r for r in self.alive() if r not in tried and r not in self.cordoned]
            if not candidates:
                self.errors["no_replica"] += 1
                raise NoReplicaError("no replica is available")
            rid = self._route(view, candidates, time.monotonic())
            tried.add(rid)
            rep = self.replicas[rid]
            req = GenerateRequest(
                request_id=f"{request_id}-{attempt}" if attempt else request_id,
                prompt_token_ids=prompt_token_ids,
                sampling=sampling,
                cache_salt=salt,
                tenant=tenant.tenant_id,
            )
            rest = self.connection(rep).stream(req)
            try:
                first = await rest.__anext__()
            except BaseException as exc:
                self.policy.on_finished(request_id, time.monotonic())
                with contextlib.suppress(Exception):
                    await rest.aclose()
                if isinstance(exc, InvalidRequestError):
                    self.errors["invalid_request"] += 1
                    raise
                if not isinstance(exc, REPLICA_FAILURES):
                    raise
                innocent = not_caused_by(exc)
                self.on_replica_failure(rid, by_request=True)
                if innocent is None:  # the engine saw it in the failing step
                    self.suspects.strike(fp, request_id, rid, strikes=2)
                elif not innocent:  # the process died, this one held answerable
                    alone = getattr(exc, "alone", False)
                    self.suspects.strike(fp, request_id, rid, strikes=2 if alone else 1)
                elif attempt == 0:
                    self.counters["retries"] += 1
                    log.warning("request %s: replica %s failed, retrying", request_id, rid)
                    continue
                raise
            rep.routed += 1
            self.policy.on_first_token(request_id, time.monotonic())
            deltas = self._failover(view, req, rid, first, rest)
            return Stream(self, request_id, rid, first, deltas, fp)
        raise AssertionError("unreachable")

    def _route(self, view: RequestView, candidates: list[str], now: float) -> str:
        """The policy's choice, counted in /metrics with its reason."""
        decision = self.policy.route(view, candidates, now)
        self.metrics.routing.labels(decision.replica, decision.reason).inc()
        return decision.replica

    async def _failover(
        self,
        view: RequestView,
        req: GenerateRequest,
        rid: str,
        first: GenerateDelta,
        rest: AsyncIterator[GenerateDelta],
    ) -> AsyncIterator[GenerateDelta]:
        """The deltas after ``first``; when the replica fails mid-stream and the failure
        cannot have been this request's doing, the request goes on once more on another
        replica from the tokens already streamed (:class:`Resume`): the client sees one
        uninterrupted stream. Otherwise -- or at a second failure -- the failing replica is
        dropped and the failure raised (the :class:`Stream` quarantines a suspect)."""
        outputs, chars = list(first.delta_token_ids), len(first.delta_text)
        current, stream, awaiting_first = rid, rest, False
        try:
            for failover in (False, True):
                try:
                    async for delta in stream:
                        if awaiting_first:  # the new replica's first token
                            awaiting_first = False
                            self.policy.on_first_token(view.request_id, time.monotonic())
                        outputs.extend(delta.delta_token_ids)
                        chars += len(delta.delta_text)
                        yield delta
                        if delta.finished:
                            return
                    return
                except REPLICA_FAILURES as exc:
                    if failover:  # one failover per request: past it, the error
                        self.on_replica_failure(current)
                        raise
                    if not_caused_by(exc) is not True:
                        self.on_replica_failure(current)
                        raise
                    self.on_replica_failure(current)
                    now = time.monotonic()
                    candidates = [
                        r for r in self.alive() if r != current and r not in self.cordoned
                    ]
                    if not candidates or not outputs:
                        raise
                    self.policy.on_finished(view.request_id, now)
                    current = self._route(view, candidates, now)
                    target = self.replicas[current]
                    resumed = msgspec.structs.replace(
                        req,
                        request_id=f"{req.request_id}-failover",
                        resume=Resume(output_token_ids=list(outputs), sent_chars=chars),
                    )
                    with contextlib.suppress(Exception):
                        await stream.aclose()  # type: ignore[attr-defined]
                    stream = self.connection(target).stream(resumed)
                    awaiting_first = True
                    target.routed += 1
                    self.counters["failovers"] += 1
                    log.warning(
                        "request %s: replica %s failed after %d tokens; continuing on %s",
                        view.request_id,
                        rid,
                        len(outputs),
                        current,
                    )
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]

    def time_first_delta(self, router_ttft_s: float, replica_ttft_s: float) -> dict[str, float]:
        """One streamed request's TTFT at the front door and at its replica; their
        difference (what routing, Ray and HTTP added) goes to /metrics."""
        added = router_ttft_s - replica_ttft_s
        self.added_latency.append(added)
        self.metrics.added.observe(max(added, 0.0))
        return {
            "replica_ttft_s": round(replica_ttft_s, 6),
            "router_ttft_s": round(router_ttft_s, 6),
        }
