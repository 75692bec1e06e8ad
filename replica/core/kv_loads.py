"""The scheduler's side of lower-tier KV loads: which waiting request loads, when it lands.

A waiting request whose cached prefix goes on past its device hit in a lower tier
(:mod:`.kv_tiers`: host memory, local disk) has that run loaded into fresh device blocks
instead of recomputed. The request leaves the queue holding those blocks (and its device
hit, touched so that it stays) until the load lands; then its blocks are cached, released,
and the request goes back to the front of its tenant's queue, where its lookup hits them.

When it lands: a load that the loader thread would finish within a small part of the step
(``INLINE_FRACTION`` of the recent step time, by the bytes over the tier's bandwidth
measured at start) is waited for in the step that starts it, and the request is admitted
in that same step. Without this, every load costs its request a whole step of waiting
while its copy took a fraction of that: on `tiny` with a 768-token device pool, chat's TTFT
p50 went from 354 to 691 ms with a host tier (BENCHMARKS, issue 38). A longer load stays
off the step: the batch runs and the request is admitted in a step after it lands. With
nothing else to run, the step waits for any load (bounded), since it holds up nobody.

Why wait for the loader thread rather than copy on the engine thread: the copy and its
checks are one code path (:meth:`KVTiers._load`), and a wait that times out (a disk that
does not answer) leaves the load running off the step, as a long one would.

Clock: unlike the scheduler, this reads time (it waits on a thread), and it is used only by
engines with real tiers; the engine tells it the step time (:attr:`KVLoads.step_seconds`).

Invariants:
- ``loading`` maps each request whose load is in flight to that request and the blocks it
  holds (its device hit, then the load's targets, in chain order); such a request is in
  neither the scheduler's waiting queue nor its running list;
- a request loads at most once per admission (``kv_load_tried``): after a failed or
  partial load it recomputes what did not arrive; a preemption clears the flag, since what
  the device evicts of a preempted request meanwhile goes to the lower tiers;
- ``_keeps`` holds (when, request) in time order, each request at most once: one queued
  with a ``kv_source``, until it has none (pulled, given up or ended).
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import TYPE_CHECKING

from kvroute.events.kv_transfer import DEFAULT_LEASE_S

from .block_pool import KVCacheBlock
from .kv_cache_manager import KVCacheManager
from .priority_queue import PriorityFairQueue
from .request import Request

if TYPE_CHECKING:
    from kvroute.events.kv_transfer import KVSource

    from ..kv_tiers.tiers import KVTiers, LoadJob

# A load waited for in its own step may lengthen that step by at most this fraction: the
# issue's bound on how much a load may slow other requests' steps (5%).
INLINE_FRACTION = 0.05
# KVROUTE_KV_INLINE_LOADS=0: no load is waited for (each lands a step later), for A/B runs;
# read when an engine's KVLoads is built.
INLINE_ENV = "KVROUTE_KV_INLINE_LOADS"
# The weight of each newly timed step in the running mean of step time.
_EMA_WEIGHT = 0.2
# The longest a step waits for a load when nothing else runs: past it, requests that arrive
# meanwhile would wait on it, and the load goes on off the step.
_MAX_WAIT_S = 0.05
# Added to a waited-for load's estimate: the loader thread's wake-up.
_WAKE_S = 1e-3
# A request that will pull its prompt from another replica (P/D, prefix fetch) may queue
# here longer than the lease its source holds for it (30 s by default), and would then
# recompute its prompt: while it waits it asks the source for KEEP_EXTEND_S more, every
# KEEP_EVERY_S (a Keep message; the source never shortens a lease for it).
KEEP_EVERY_S = DEFAULT_LEASE_S / 3
KEEP_EXTEND_S = DEFAULT_LEASE_S


class KVLoads:
    """Starts and lands one engine's lower-tier loads, for its scheduler."""

    def __init__(
        self, tiers: KVTiers, kv_cache_manager: KVCacheManager, waiting: PriorityFairQueue[Request]
    ) -> None:
        self.tiers = tiers
        self.kv = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.waiting = waiting
        self.loading: dict[str, tuple[Request, list[KVCacheBlock]]] = {}
        self.step_seconds = 0.0  # mean wall time of recent model steps (set by the engine)
        self.num_inline = 0  # loads landed in the step that started them
        self.num_keeps = 0  # Keep messages sent for waiting requests' leases
        self._keeps: deque[tuple[float, Request]] = deque()  # (when, request), in that order
        self.inline = os.environ.get(INLINE_ENV, "1") != "0"  # short loads waited for in-step

    def note_step(self, seconds: float) -> None:
        """The engine timed a step that ran the model: a running mean of step time."""
        s = self.step_seconds
        self.step_seconds = seconds if s == 0.0 else s + _EMA_WEIGHT * (seconds - s)

    def poll(self) -> None:
        """At the start of each step: the tiers' own news (failed disk writes), then the
        loads that landed since the last step."""
        self.tiers.poll()
        if self.loading:
            self.land()
        if self._keeps:
            self._keep_leases()

    def track(self, req: Request) -> None:
        """A request queued with a ``kv_source``: its lease there is kept while it waits."""
        if req.kv_source is not None and self.tiers.remote is not None:
            self._keeps.append((time.monotonic() + KEEP_EVERY_S, req))

    def _keep_leases(self) -> None:
        """Sends a Keep for each waiting request whose turn came (one period apart, so
        the deque stays in time order); a request that pulled, gave its source up or ended
        has no ``kv_source`` left and leaves the deque."""
        now = time.monotonic()
        keeps = self._keeps
        while keeps and keeps[0][0] <= now:
            _, req = keeps.popleft()
            source = req.kv_source
            if source is None:
                continue
            self.tiers.keep_remote(source, KEEP_EXTEND_S)
            self.num_keeps += 1
            keeps.append((now + KEEP_EVERY_S, req))

    def start(self, req: Request, hit: list[KVCacheBlock], *, alone: bool) -> bool:
        """Starts loading the lower-tier run of blocks after ``req``'s device hit (``req``
        is at the front of the queue), when there is one and room for it; a request with a
        ``kv_source`` (its prompt computed on another replica) pulls from there what its own
        tiers lack. True: the request left the queue, or it is back at its front with the
        blocks landed (a short load, or any load when ``alone``: nothing else is in this
        step)."""
        source, req.kv_source = req.kv_source, None  # one pull per request, at most
        kv = self.kv
        if req.kv_load_tried or req.skip_reading_prefix_cache or not kv.enable_caching:
            return self._unused(source)
        hashes = kv.block_hashes(req)
        max_blocks = max(req.num_tokens - 1, 0) // self.block_size
        tiers = self.tiers
        media = tiers.lookup(hashes, len(hit), max_blocks)
        num_remote = 0
        if source is not None:
            num_remote = max(min(source.num_blocks, max_blocks) - len(hit) - len(media), 0)
        num_load = len(media) + num_remote
        if not num_load:
            return self._unused(source)
        pool = kv.block_pool
        evictable = sum(1 for b in hit if b.ref_cnt == 0)
        if num_load + 1 > pool.get_num_free_blocks() - evictable:
            return self._unused(source)  # no room now: it computes them (never waits)
        req.kv_load_tried = True
        job = tiers.prepare(
            req.request_id,
            hashes[len(hit) : len(hit) + num_load],
            start=len(hit),
            num_remote=num_remote,
            source=source,
        )
        if source is not None and not num_remote:
            tiers.release_remote(source)  # its own tiers hold all it needs
        pool.touch(hit)  # the device prefix stays while the rest loads
        new = pool.get_new_blocks(num_load)
        self.waiting.popleft()
        self.loading[req.request_id] = (req, [*hit, *new])
        tiers.start(job, [b.block_id for b in new])
        estimate = self.estimate(job)
        short = self.inline and (alone or estimate <= INLINE_FRACTION * self.step_seconds)
        # Twice the estimate, and the thread's wake-up.
        if short and job.done.wait(min(2.0 * estimate + _WAKE_S, _MAX_WAIT_S)):
            self.num_inline += 1
            self.land()
        return True

    def _unused(self, source: KVSource | None) -> bool:
        """A request that loads nothing: its source's lease, if it had one, is freed."""
        if source is not None:
            self.tiers.release_remote(source)
        return False

    def drop_source(self, req: Request) -> None:
        """``req`` ended before it could pull (aborted while waiting): free its lease."""
        source, req.kv_source = req.kv_source, None
        self._unused(source)

    def estimate(self, job: LoadJob) -> float:
        """Seconds the load should take: its bytes over each tier's measured bandwidth
        (infinite when a tier's bandwidth is unknown: never waited for in a busy step)."""
        rates = self.tiers.bytes_per_s
        nbytes = self.tiers.block_bytes
        total = 0.0
        for medium in job.media:
            rate = rates.get(medium, 0.0)
            if rate <= 0.0:
                return float("inf")
            total += nbytes / rate
        return total

    def land(self) -> None:
        """Caches the blocks of each landed load that arrived intact, releases its hold,
        and puts its request back at the front of the queue: its lookup now hits them."""
        kv = self.kv
        pool = kv.block_pool
        for job in self.tiers.take_done():
            req, blocks = self.loading.pop(job.request_id)
            n_hit = len(blocks) - len(job.block_ids)
            if job.num_ok:
                pool.cache_full_blocks(
                    blocks,
                    kv.block_hashes(req),
                    n_hit,
                    n_hit + job.num_ok,
                    self.block_size,
                    req.all_token_ids,
                    lora_name=req.lora_name,
                )
                tiers = req.tier_cached_tokens
                for medium in job.media[: job.num_ok]:
                    tiers[medium] = tiers.get(medium, 0) + self.block_size
            pool.free_blocks(reversed(blocks))
            if not req.is_finished:
                self.waiting.appendleft(req)
            else:  # finished while loading: its hashes were kept for the caching above
                kv.req_to_block_hashes.pop(req.request_id, None)


def clamp_tiers(tiers: dict[str, int], num_hit: int) -> None:
    """Loaded blocks evicted again before admission were recomputed: a tier counts only
    what the hit still held."""
    left = num_hit
    for medium in list(tiers):
        tiers[medium] = min(tiers[medium], left)
        left -= tiers[medium]
