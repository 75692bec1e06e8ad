"""A source replica's leases: the prompt blocks it holds for another replica to pull.

When a request hands off (its prefill done here, its decode elsewhere), its full prompt
blocks would go back to the pool and could be evicted before the other replica pulls them.
A lease keeps one more reference on each, so they stay cached and unwritten, until the
puller says it is done, or the lease expires (the puller died, or the front door did), or
the pool needs the room more (:meth:`Leases.revoke_oldest`, when an admission fails).

Why a lease is safe to read from another thread: a full block with a reference is never
handed to a new owner, so its bytes do not change while it is leased. The only hazard is a
lease ending *during* a read; a reader therefore takes the lease with :meth:`Leases.open`
and gives it back with :meth:`Leases.close`, and the engine thread ends no lease a reader
holds (it ends it at the first poll after).

A prefix fetch (a request routed to one replica, its prefix held by another) comes with no
lease: the holder computed the prefix for other requests. The puller names the blocks by
hash, and the holder leases what its cache holds of them for the pull's length
(:meth:`Leases.pin`): asked from the plane's thread, granted on the engine thread at its next
poll, released by the server once the pull ends. A hash folds in the tenant's salt and the
adapter, so a puller can only name blocks its own request would have computed.

Invariants:
- each lease holds exactly one reference on each of its blocks, taken at :meth:`grant`
  and given back exactly once, on the engine thread (release, expiry, revoke, clear);
- ``hashes[i]`` is ``blocks[i]``'s hash at grant, and stays so while the lease lives;
- ``_leases`` and each lease's ``readers`` change under ``_lock``; the pool only on the
  engine thread (:meth:`grant`, :meth:`poll`, :meth:`revoke_oldest`, :meth:`clear`).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvroute.events.kv_transfer import PULL_MISMATCH, PULL_UNKNOWN

if TYPE_CHECKING:
    from ..core.block_pool import BlockPool, KVCacheBlock

LEASE_ID_BYTES = 16


@dataclass(slots=True, eq=False)
class _PinAsk:
    """A fetch's ask for the cached blocks of ``hashes``, answered on the engine thread."""

    hashes: list[bytes]
    ready: threading.Event = field(default_factory=threading.Event)
    lease: Lease | None = None
    taken: bool = False  # the engine thread is answering it
    cancelled: bool = False  # the asker stopped waiting: grant nothing


@dataclass(slots=True, eq=False)
class Lease:
    lease_id: bytes
    request_id: str
    blocks: list[KVCacheBlock]
    hashes: list[bytes]
    expiry: float  # on the leases' clock
    readers: int = 0  # pulls reading its blocks now (see the module docstring)
    ended: bool = False  # released or expired while read: freed at the next poll


class Leases:
    """The leases of one engine's block pool."""

    def __init__(
        self,
        pool: BlockPool,
        lease_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"kv_lease_s must be > 0, got {lease_s}")
        self.pool = pool
        self.lease_s = lease_s
        self.clock = clock
        self._leases: dict[bytes, Lease] = {}  # in grant order: the oldest first
        self._lock = threading.Lock()
        self._released: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._pins: queue.SimpleQueue[_PinAsk] = queue.SimpleQueue()
        # Wakes an idle engine thread so that it polls (set by the async engine); None: the
        # engine polls on its own often enough (tests that step by hand).
        self.wake: Callable[[], None] | None = None
        self.stats = {
            "granted": 0, "released": 0, "expired": 0, "revoked": 0, "pinned": 0, "pin_misses": 0
        }  # fmt: skip

    # -- engine thread -------------------------------------------------------------------
    def grant(self, request_id: str, blocks: Sequence[KVCacheBlock]) -> Lease:
        """Leases ``blocks`` (full and cached, in chain order): one reference each."""
        hashes = []
        for b in blocks:
            if b.block_hash is None:
                raise ValueError(f"request {request_id!r}: block {b.block_id} is not cached")
            hashes.append(b.block_hash)
        self.pool.touch(blocks)
        lease = Lease(os.urandom(LEASE_ID_BYTES), request_id, list(blocks), hashes, 0.0)
        lease.expiry = self.clock() + self.lease_s
        with self._lock:
            self._leases[lease.lease_id] = lease
        self.stats["granted"] += 1
        return lease

    def poll(self) -> None:
        """Each step: grants the fetches' pins, frees the leases released since, and those
        past their expiry."""
        while not self._pins.empty():  # one consumer: this thread (no Empty raised per step)
            self._pin(self._pins.get_nowait())
        ended: list[Lease] = []
        now = self.clock()
        with self._lock:
            while True:
                try:
                    lease_id = self._released.get_nowait()
                except queue.Empty:
                    break
                lease = self._leases.get(lease_id)
                if lease is not None:
                    lease.ended = True
                    self.stats["released"] += 1
            for lease in self._leases.values():
                if not lease.ended and lease.expiry <= now:
                    lease.ended = True
                    self.stats["expired"] += 1
                if lease.ended and not lease.readers:
                    ended.append(lease)
            for lease in ended:
                del self._leases[lease.lease_id]
        for lease in ended:
            self.pool.free_blocks(reversed(lease.blocks))

    def pin_cached(self, hashes: Sequence[bytes]) -> Lease | None:
        """A fetch's lease on the longest run of ``hashes``, from the first, that the cache
        holds (None: not even the first). What :meth:`pin` asks for, granted now."""
        blocks = self._cached(hashes)
        if not blocks:
            self.stats["pin_misses"] += 1
            return None
        self.stats["pinned"] += 1
        return self.grant("fetch", blocks)

    def _cached(self, hashes: Sequence[bytes]) -> list[KVCacheBlock]:
        blocks = []
        for h in hashes:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _pin(self, ask: _PinAsk) -> None:
        """Answers ``ask`` (:meth:`pin_cached`), unless its asker stopped waiting."""
        with self._lock:  # the asker gives up, or waits for this answer: never both
            if ask.cancelled:
                return
            ask.taken = True
        ask.lease = self.pin_cached(ask.hashes)
        ask.ready.set()

    def revoke_oldest(self) -> bool:
        """Frees the oldest lease no pull is reading (the pool needs its blocks more than
        its puller, who will recompute them). False: none could be."""
        with self._lock:
            victim = next((x for x in self._leases.values() if not x.readers), None)
            if victim is None:
                return False
            del self._leases[victim.lease_id]
        self.stats["revoked"] += 1
        self.pool.free_blocks(reversed(victim.blocks))
        return True

    def clear(self) -> None:
        """Before the pool is reset: every lease ends (pulls in flight end unknown)."""
        with self._lock:
            held = [x for x in self._leases.values() if not x.readers]
            for lease in held:
                del self._leases[lease.lease_id]
            for lease in self._leases.values():
                lease.ended = True
        for lease in held:
            self.pool.free_blocks(reversed(lease.blocks))

    @property
    def num_blocks(self) -> int:
        """Blocks held by leases (some may also be held by requests)."""
        with self._lock:
            return sum(len(x.blocks) for x in self._leases.values())

    def __len__(self) -> int:
        return len(self._leases)

    # -- any thread ------------------------------------------------------------------------
    def open(self, lease_id: bytes, start: int, hashes: Sequence[bytes]) -> list[int] | str:
        """The block ids of ``hashes``, the lease's from position ``start``, held for
        reading until :meth:`close`; or why not (``PULL_UNKNOWN``, ``PULL_MISMATCH``)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.ended:
                return PULL_UNKNOWN
            stop = start + len(hashes)
            if start < 0 or stop > len(lease.hashes) or lease.hashes[start:stop] != list(hashes):
                return PULL_MISMATCH
            lease.readers += 1
            return [b.block_id for b in lease.blocks[start:stop]]

    def close(self, lease_id: bytes) -> None:
        """A read that :meth:`open` allowed is over."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None:
                lease.readers -= 1

    def pin(self, hashes: Sequence[bytes], wait_s: float) -> Lease | None:
        """A lease on the cached blocks of ``hashes`` (the longest run from the first), for
        a fetch to read and then :meth:`release`; None if the cache holds none of them, or
        the engine did not poll within ``wait_s``."""
        ask = _PinAsk(list(hashes))
        self._pins.put(ask)
        if self.wake is not None:
            self.wake()
        if not ask.ready.wait(wait_s):
            with self._lock:
                if not ask.taken:
                    ask.cancelled = True
                    return None
            ask.ready.wait()  # being granted now, on the engine thread
        return ask.lease

    def keep(self, lease_id: bytes, extend_s: float) -> bool:
        """The puller still waits: the lease lives ``extend_s`` from now (at least)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.ended:
                return False
            lease.expiry = max(lease.expiry, self.clock() + max(extend_s, 0.0))
            return True

    def release(self, lease_id: bytes) -> None:
        """The puller is done: the blocks are freed at the engine's next poll."""
        self._released.put(lease_id)
