"""P/D disaggregation in the simulator: roles, the link, the handoff and the pull.

A fleet with roles (``SimConfig.prefill_replicas`` / ``decode_replicas``; the rest are
``both``) runs what a front door and its engines run for issue 51, on the simulation's clock:

- **where a request goes**: the router's own :func:`~kvroute.router.routing.disagg.plan`
  (priced by :func:`~kvroute.router.routing.disagg.split_pays` with the fleet's policy, or,
  ``pd_split="always"``, every splittable request splits), then the policy's choice among
  the part's candidates, as :meth:`RequestRun._send` does;
- **the handoff**: a prefill replica's scheduler has the engine's
  :class:`~kvroute.replica.kv_transfer.leases.Leases`; a ``kv_handoff`` request that gets
  its first token there is ended by :meth:`Scheduler.hand_off` (``FINISHED_HANDOFF``, its
  full prompt blocks leased) after that step, as the engine does; the client has its first
  token then (TTFT is the prefill replica's), and, as :meth:`RequestRun._hand_off` does,
  the policy forgets the prefill flight and routes the decode part among the replicas that
  decode;
- **the pull**: the decode part (:class:`HandedOff`: the prompt and its first token, as a
  ``Resume`` carries it, with its ``kv_source``) joins its decode replica's queue between
  two steps. When it reaches the head of that queue the engine's scheduler calls its
  loads' ``start``, as it does :meth:`KVLoads.start` for a ``REMOTE`` load; here
  :class:`SimPulls` answers it the way ``KVLoads`` does: the replica's own device hit is
  held, fresh blocks are taken for the rest of the lease's blocks (too few free: no pull,
  the prompt is computed there), the lease is opened (a read: never revoked meanwhile;
  already revoked or expired: no pull), and the request leaves the queue holding those
  blocks (``Scheduler.loading``: the scheduler waits for them rather than fail an
  admission). The blocks arrive ``bytes / link + latency`` later; at the replica's next
  step they are cached under their hashes (its own ``BlockStored``) and released, the
  lease is closed and released (the prefill replica frees its blocks at its next step),
  and the request goes back to the front of the queue, where its lookup hits them. It then
  computes the tail (the prompt past its last full block, and the first token) and
  decodes. A source that restarted meanwhile sent nothing: the request computes it all;
- **the link**: each replica has one NIC, full duplex; a pull occupies the source's send
  side and the destination's receive side for ``bytes / link_bytes_per_s`` (pulls queue
  first come, first served on each side), then ``link_latency_s`` passes before it lands.

What is not modelled: ``KVLoads``' inline landing (a short load waited for within the step
that starts it; here a landed pull is admitted at the next step, which starts at once when
the replica is idle); partial pulls (a pull lands whole or not at all); a link shared by
the replicas of one host.

Why the router's code and the engine's scheduler, not copies: the point of the simulation
is to say whether the router's split rule and its price pay on the engine as it is.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvroute.events.replica_api import GenerateRequest
from kvroute.replica.core import kv_loads
from kvroute.replica.core.fair_queue import FairQueue
from kvroute.replica.core.kv_cache_manager import KVCacheManager
from kvroute.replica.core.request import Request
from kvroute.replica.kv_transfer.leases import Leases
from kvroute.router.routing.disagg import (
    ROLE_BOTH,
    ROLE_DECODE,
    ROLE_PREFILL,
    plan,
    route_decode,
)
from kvroute.router.routing.policy import RequestView

from .replica import OUTPUT_TOKEN, SimReplica, SimRequest

if TYPE_CHECKING:
    from kvroute.replica.core.block_pool import KVCacheBlock
    from kvroute.replica.core.scheduler import Scheduler
    from kvroute.replica.kv_transfer.leases import Lease

    from .simulator import SimConfig, SimRun

PD_SPLITS = ("priced", "always")  # SimConfig.pd_split
_LINK_EMA = 0.2  # the weight of each pull in a replica's measured link (the fetcher's)


class HandedOff(SimRequest):
    """The decode part of a split request, on its decode replica: its prompt and the first
    token the prefill replica made (a ``Resume``), fresh to that replica's scheduler.
    Reports the request as a client saw it: its first token when the prefill replica made
    it, its hit the prefill replica's (what the prefix cache saved); ``decode_hit``: the
    prompt tokens it found at its decode replica, pulled or held there."""

    def __init__(self, src: SimRequest, now: float, fair_share: bool) -> None:
        super().__init__(src.idx, src.spec, src.prompt_token_ids, now, fair_share)  # type: ignore[arg-type]
        self.append_output_token(OUTPUT_TOKEN)
        self.resumed = True  # until its first token on the decode replica
        self.first_s = src.first_s
        self.scheduled_s = src.scheduled_s
        self.prefill_replica = src.replica
        self.prefill_hit = src.hit or 0
        self._prefill_host_hit = src.host_hit
        self.pulled_tokens = 0  # of its prompt, brought over the link

    @property
    def hit(self) -> int | None:
        return self.prefill_hit

    @property
    def decode_hit(self) -> int | None:
        return self.num_cached_tokens if self.num_cached_tokens >= 0 else None

    @property  # type: ignore[override]
    def host_hit(self) -> int:
        return self._prefill_host_hit

    @host_hit.setter
    def host_hit(self, value: int) -> None:
        pass  # a host load on the decode replica: not the prefix cache's saving


@dataclass(slots=True, eq=False)
class Pull:
    """A decode part's source (its ``kv_source``), and then its pull."""

    req: HandedOff
    src: SimReplica  # the prefill replica
    src_sched: Scheduler  # its scheduler at the handoff (another one: it restarted)
    lease: Lease | None  # None: no full prompt block to pull
    handed_s: float
    dst_sched: Scheduler | None = None  # the decode replica's, once the pull started
    blocks: list[KVCacheBlock] = field(default_factory=list)  # its hit, then the targets
    num_hit: int = 0  # blocks of its own device hit
    num_load: int = 0  # blocks pulled
    start_s: float = 0.0

    @property
    def source_alive(self) -> bool:
        return self.src.scheduler is self.src_sched

    def release(self, opened: bool = False) -> None:
        """The puller is done with the lease (a ``Done``): it ends at the source's next
        step. Nothing when the source restarted: its leases went with it."""
        if self.lease is None or not self.source_alive:
            return
        leases = self.src_sched.leases
        assert leases is not None
        if opened:
            leases.close(self.lease.lease_id)
        leases.release(self.lease.lease_id)


@dataclass(slots=True)
class PDStats:
    split: int = 0  # requests (retries included) whose prefill went to a prefill replica
    whole: int = 0  # routed whole on a fleet with prefill replicas
    handoffs: int = 0
    pulls: int = 0  # pulls that landed
    pulled_tokens: int = 0
    # of the pulls that landed, summed: from the handoff to the pull's start (the decode
    # replica's queue), and from there to its landing at a step (the link's queue included)
    queue_s: float = 0.0
    pull_s: float = 0.0
    link_s: float = 0.0  # bytes over the link, summed
    no_pull: int = 0  # nothing to pull: no lease, or the decode replica held it all
    no_room: int = 0  # the decode replica had too few free blocks: computed there
    failed: int = 0  # the lease was gone (revoked, expired) or its source restarted
    dropped: int = 0  # at a decode replica that restarted: retried


class SimPulls:
    """A decode replica's pulls, as its scheduler sees them: the engine's
    :class:`~kvroute.replica.core.kv_loads.KVLoads` interface (``loading``, ``poll``,
    ``start``, ``drop_source``, ``track``), with the link's time in place of a loader
    thread."""

    def __init__(self, pd: Disagg, index: int, kv: KVCacheManager, waiting: FairQueue) -> None:
        self.pd, self.index, self.kv, self.waiting = pd, index, kv, waiting
        self.loading: dict[str, tuple[Request, list[KVCacheBlock]]] = {}
        self.pulls: dict[str, Pull] = {}  # by request id, while loading
        self.landed: list[Pull] = []
        # What its pulls took, bytes/s, a running mean, as the engine's fetcher measures it
        # and its load reports carry it (the router prices splits by it). Before its first
        # pull: the link's own rate, as a probe at start would measure it (0, the engine's
        # "none yet", would price every split at the router's 1 GB/s floor: on a fleet of
        # both, where pulls only follow splits, none would ever split)
        self.bytes_per_s = pd.link_bytes_per_s
        self._keeps: deque[tuple[float, Request]] = deque()  # as KVLoads': (when, request)

    def poll(self) -> None:
        if self.landed:
            self.land()
        if self._keeps:
            self._keep_leases()

    def start(self, req: Request, hit: list[KVCacheBlock], *, alone: bool) -> bool:
        """``req`` is at the head of the queue: starts its pull (True: it left the queue),
        or gives its source up (False: it computes what it lacks)."""
        p = req.kv_source
        if p is None:
            return False
        req.kv_source = None  # one pull per request, at most
        assert isinstance(p, Pull)
        return self.pd.start(p, self, hit)

    def track(self, req: Request) -> None:
        """A request queued with a source: its lease there is kept alive while it waits,
        as the engine's Keep messages do (:meth:`KVLoads.track`), on the simulation's clock."""
        self._keeps.append((self.pd.clock() + kv_loads.KEEP_EVERY_S, req))

    def _keep_leases(self) -> None:
        now = self.pd.clock()
        keeps = self._keeps
        while keeps and keeps[0][0] <= now:
            _, req = keeps.popleft()
            p = req.kv_source
            if not isinstance(p, Pull):  # pulled, given up, or ended
                continue
            if p.lease is not None and p.source_alive:
                leases = p.src_sched.leases
                assert leases is not None
                leases.keep(p.lease.lease_id, kv_loads.KEEP_EXTEND_S)
            keeps.append((now + kv_loads.KEEP_EVERY_S, req))

    def drop_source(self, req: Request) -> None:
        """``req`` ended before its pull: its lease goes."""
        p, req.kv_source = req.kv_source, None
        if isinstance(p, Pull):
            p.release()

    def arrived(self, p: Pull, now: float) -> None:
        """``p``'s bytes are all there: it lands at the next step; the fetcher's measure."""
        self.landed.append(p)
        if p.source_alive and now > p.start_s:
            rate = p.num_load * self.kv.block_size * self.pd.kv_bytes / (now - p.start_s)
            old = self.bytes_per_s
            self.bytes_per_s = rate if old <= 0 else old + _LINK_EMA * (rate - old)

    def land(self) -> None:
        """The pulls whose blocks arrived since the last step: cached and released, their
        requests back at the front of the queue (as :meth:`KVLoads.land`)."""
        kv, stats = self.kv, self.pd.stats
        pool, bs = kv.block_pool, kv.block_size
        landed, self.landed = self.landed, []
        for p in landed:
            req, blocks = self.loading.pop(p.req.request_id)
            del self.pulls[p.req.request_id]
            if p.source_alive:
                p.release(opened=True)
                end = p.num_hit + p.num_load
                pool.cache_full_blocks(
                    blocks, kv.block_hashes(req), p.num_hit, end, bs, req.all_token_ids,
                    lora_name=req.lora_name,
                )  # fmt: skip
                p.req.pulled_tokens = p.num_load * bs
                stats.pulls += 1
                stats.pulled_tokens += p.req.pulled_tokens
                stats.queue_s += p.start_s - p.handed_s
                stats.pull_s += self.pd.clock() - p.start_s
            else:  # its source's engine is gone: nothing arrived, the request computes it
                stats.failed += 1
            pool.free_blocks(reversed(blocks))
            if not req.is_finished:
                self.waiting.appendleft(req)
            else:
                kv.req_to_block_hashes.pop(req.request_id, None)


class Disagg:
    """A P/D fleet's roles, links and transfers, for one :class:`SimRun`."""

    def __init__(self, cfg: SimConfig, roles: Sequence[str], clock: Callable[[], float]) -> None:
        self.roles = list(roles)
        self.role_by_id = {f"replica-{i}": role for i, role in enumerate(roles)}
        self.priced = cfg.pd_split == "priced"
        self.lease_s = cfg.lease_s
        self.kv_bytes = cfg.profile(0).kv_bytes_per_token  # one model: every profile's
        self.link_bytes_per_s = cfg.link_bytes_per_s
        self.latency_s = cfg.link_latency_s
        self.clock = clock
        # pairs on a fleet of both (SimConfig.pd_pair): every replica leases and pulls
        self.pair = cfg.pd_pair
        self.decode_for: dict[str, str] = {}  # request -> the decode replica its price chose
        self.has_prefill = ROLE_PREFILL in roles or self.pair
        n = len(roles)
        self.tx_free = [0.0] * n  # when each replica's send side is free again
        self.rx_free = [0.0] * n
        self.stats = PDStats()
        self.run: SimRun | None = None  # bound once the fleet exists

    def role_of(self, rid: str) -> str:
        return self.role_by_id[rid]

    def attach(self, i: int) -> Callable[[Scheduler], None]:
        """What replica ``i``'s every new scheduler gets: leases on a prefill replica, the
        pulls of :class:`SimPulls` on one that decodes."""

        def attach(sched: Scheduler) -> None:
            kv = sched.kv_cache_manager
            if self.roles[i] == ROLE_PREFILL or self.pair:
                sched.use_leases(Leases(kv.block_pool, self.lease_s, self.clock))
            if self.roles[i] != ROLE_PREFILL or self.pair:
                sched.kv_loads = SimPulls(self, i, kv, sched.waiting)  # type: ignore[assignment]

        return attach

    # -- routing -----------------------------------------------------------------------
    def candidates(
        self, req: SimRequest, view: RequestView, alive: list[str], now: float
    ) -> list[str]:
        """The replicas the request (or, after a failure, its retry) may go to now, by the
        router's :func:`plan`; marks it ``kv_handoff`` when its prefill goes alone."""
        assert self.run is not None
        decoding = req.first_s is not None  # a retry whose client has its first token
        gen = GenerateRequest(
            request_id=req.request_id, prompt_token_ids=[], sampling=req.sampling_params
        )
        policy = self.run.policy if self.priced else None
        part = plan(
            gen, alive, self.role_of, decoding=decoding, view=view, policy=policy, now=now,
            pair=self.pair,
        )  # fmt: skip
        req.kv_handoff = part.handoff
        if part.decode is not None:
            self.decode_for[req.request_id] = part.decode
        if self.has_prefill and not decoding:
            if part.handoff:
                self.stats.split += 1
            else:
                self.stats.whole += 1
        return part.candidates

    def hand_off(self, rep: SimReplica) -> None:
        """The requests ``rep`` handed off in its last step: each decode part routed among
        the replicas that decode, and sent there with its source."""
        run = self.run
        assert run is not None
        now, policy = run.now, run.policy
        handoffs, rep.handoffs = rep.handoffs, []
        for src, lease in handoffs:
            self.stats.handoffs += 1
            policy.on_finished(src.request_id, now, None)  # one token: no output length
            req = HandedOff(src, now, run.cfg.fair_share)
            alive = [r.id for r in run.reps if r.alive]
            gen = GenerateRequest(
                request_id=req.request_id, prompt_token_ids=[], sampling=req.sampling_params
            )
            candidates = plan(gen, alive, self.role_of, decoding=True).candidates
            if self.pair:  # the replica its price chose, else any but its prefill's
                d = self.decode_for.pop(src.request_id, None)
                others = [r for r in candidates if r != rep.id] or candidates
                candidates = [d] if d in others else others
            if self.pair:  # booked with the prefill it does there: its tail
                held = len(lease.blocks) * run.cfg.block_size if lease is not None else 0
                decision = route_decode(policy, run.view(req), candidates, now, held)
            else:
                decision = policy.route(run.view(req), candidates, now)
            dst = run.replica(decision.replica)
            req.replica = run.index_of(decision.replica)
            req.kv_source = Pull(req, rep, rep.scheduler, lease, now)  # type: ignore[assignment]
            dst.routed += 1
            run.reqs[req.idx] = req
            dst.inbox.append(req)
            run.kick(dst)

    # -- the pull ----------------------------------------------------------------------
    def start(self, p: Pull, pulls: SimPulls, hit: list[KVCacheBlock]) -> bool:
        """Starts ``p``'s pull into ``pulls``' replica (True), or gives it up (False)."""
        run, stats, req = self.run, self.stats, p.req
        assert run is not None
        kv = pulls.kv
        if req.kv_load_tried or req.skip_reading_prefix_cache or not kv.enable_caching:
            p.release()
            return False
        lease = p.lease
        if lease is None:
            stats.no_pull += 1
            return False
        if not p.source_alive:
            stats.failed += 1
            return False
        bs = kv.block_size
        max_blocks = max(req.num_tokens - 1, 0) // bs
        first = len(hit)
        num_load = max(min(len(lease.blocks), max_blocks) - first, 0)
        if not num_load:
            stats.no_pull += 1
            p.release()
            return False
        pool = kv.block_pool
        evictable = sum(1 for b in hit if b.ref_cnt == 0)
        if num_load + 1 > pool.get_num_free_blocks() - evictable:
            stats.no_room += 1  # no room now: it computes them (never waits)
            p.release()
            return False
        leases = p.src_sched.leases
        assert leases is not None
        hashes = kv.block_hashes(req)[first : first + num_load]
        if isinstance(leases.open(lease.lease_id, first, hashes), str):
            stats.failed += 1  # revoked or expired before the pull: the puller recomputes
            return False
        req.kv_load_tried = True
        pool.touch(hit)  # the device prefix stays while the rest arrives
        p.blocks = [*hit, *pool.get_new_blocks(num_load)]
        p.num_hit, p.num_load = first, num_load
        dst = run.reps[pulls.index]
        p.dst_sched = dst.scheduler
        pulls.waiting.popleft()
        pulls.loading[req.request_id] = (req, p.blocks)
        pulls.pulls[req.request_id] = p
        now = run.now
        i, j = pulls.index, run.index_of(p.src.id)
        xfer = num_load * bs * self.kv_bytes / self.link_bytes_per_s
        begin = max(now, self.tx_free[j], self.rx_free[i])
        self.tx_free[j] = self.rx_free[i] = begin + xfer
        p.start_s = now
        land = begin + xfer + self.latency_s
        stats.link_s += xfer
        run.push_land(land, p)
        return True

    def arrived(self, p: Pull) -> None:
        """``p``'s bytes are all there: its replica lands it at its next step."""
        run = self.run
        assert run is not None
        dst = run.reps[p.req.replica]
        if dst.scheduler is not p.dst_sched:
            return  # the decode replica restarted: the request was retried from scratch
        pulls = dst.scheduler.kv_loads
        assert isinstance(pulls, SimPulls)
        pulls.arrived(p, run.now)
        run.kick(dst)

    def drop(self, rep: SimReplica) -> list[SimRequest]:
        """``rep``'s engine is about to go: the requests whose pulls it was waiting for (the
        front door retries them, as it does the requests it runs); the leases of every pull
        it had end (the sources see their puller go)."""
        sched = rep.scheduler
        pulls = sched.kv_loads
        if not isinstance(pulls, SimPulls):
            return []
        for p in pulls.pulls.values():
            p.release(opened=True)
        for req in (*rep.inbox, *sched.waiting, *sched.running):
            p = req.kv_source
            if isinstance(p, Pull):
                req.kv_source = None
                p.release()
        lost = [req for req, _ in pulls.loading.values()]
        self.stats.dropped += len(lost)
        pulls.loading.clear()
        pulls.pulls.clear()
        return lost  # type: ignore[return-value]

    # -- figures -----------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """What a run's summary reports of P/D."""
        assert self.run is not None
        s, reps = self.stats, self.run.reps
        decode_prefill = sum(
            r.prefill_tokens
            for r, role in zip(reps, self.roles, strict=True)
            if role != ROLE_PREFILL
        )
        return {
            "roles": self.roles,
            "pd_split": "priced" if self.priced else "always",
            "pd_pair": self.pair,
            "split_requests": s.split,
            "whole_requests": s.whole,
            "split_fraction": s.split / max(s.split + s.whole, 1),
            "handoffs": s.handoffs,
            "pulls": s.pulls,
            "pulled_tokens": s.pulled_tokens,
            "pull_queue_s_mean": s.queue_s / s.pulls if s.pulls else 0.0,
            "pull_s_mean": s.pull_s / s.pulls if s.pulls else 0.0,
            "link_busy_s": s.link_s,
            "no_pull": s.no_pull,
            "pull_no_room": s.no_room,
            "pull_failed": s.failed,
            "pull_dropped": s.dropped,
            # what the replicas that decode computed of prompts (tails, and whole requests)
            "decoders_prefill_tokens": decode_prefill,
        }


def roles_of(prefill: int, decode: int, replicas: int) -> list[str]:
    """Replica i's role: the first ``prefill`` replicas prefill, the next ``decode`` decode,
    the rest do both."""
    if prefill < 0 or decode < 0 or prefill + decode > replicas:
        raise ValueError(
            f"{prefill} prefill + {decode} decode replicas do not fit a fleet of {replicas}"
        )
    return [
        ROLE_PREFILL if i < prefill else ROLE_DECODE if i < prefill + decode else ROLE_BOTH
        for i in range(replicas)
    ]
