"""The KV cache's lower tiers: host memory and local disk beneath the device pool.

A block the device pool evicts (:meth:`BlockPool.get_new_blocks`, its hash about to be torn
down) is copied out here before anything can overwrite it, into the host tier (an LRU of
``kv_host_bytes``); what the host tier pushes out goes on to the disk tier
(:mod:`.kv_disk`), which may also be used alone; its files are written by a writer thread
(:mod:`.kv_disk_writer`), the engine thread only queues them. A waiting request whose cached
prefix goes on in a lower tier has those blocks loaded back into fresh device blocks by a
loader thread (:meth:`KVTiers.start`); the scheduler keeps it out of the batch until they
land, then it hits them as ordinary device blocks. Each copy carries an xxh3-64 of its
bytes, checked on load: a block that fails -- corrupt, truncated, missing, or an exception
-- ends the load there, is dropped from its tier, and the request recomputes from there.

Why copy out at eviction, in the eviction's call: an evicted block is handed to a new owner
at once and written in the same step, so its bytes must be read first or the block held
back. A block is small (tiny: 8 KiB; an 8B model: 2 MiB), one copy of it costs less than
the bookkeeping a deferred copy needs (BENCHMARKS: issue 38). On CUDA the copy is enqueued on
the step's own stream (a gather, then a device-to-host copy into pinned memory), ahead of
the forward that overwrites the block, so stream order keeps it right without the host
waiting; the copy records an event. Its checksum needs the bytes, so the loader thread
computes it (:meth:`HostEntry.seal`: it waits for the event), off the step on both devices.
Loads go the other way on a side stream, which first waits for what the step's stream had
enqueued when the load started (a copy-out of the very blocks the load writes, among
others). Writing the copy to disk is slower and needs no device: the writer thread does
it, the bytes held in memory (and loadable from there) until the file is in place.

Disk reads run neither on the engine thread nor unbounded (issue 50): a load's disk blocks
are read first, within a deadline (:mod:`.kv_disk_reads`), then the loader copies, so no
host load waits behind a hung disk. A disk folder deleted or replaced turns the disk tier
off at the next :meth:`KVTiers.poll`, withdrawing what it held (``BlockRemoved`` STORAGE).

Events: the tiers speak through the pool's event list (:meth:`BlockPool.emit`), in the order
things happen: ``BlockStored``/``BlockRemoved`` with ``medium`` "CPU" (host) or "STORAGE"
(disk), each block with its own parent hash and tokens, as the device's events give them.
A reset (``AllBlocksCleared``) empties every tier. A disk block's ``BlockStored`` goes out
when its write is queued (its bytes are held and loadable from then on); a write that fails
later is announced by a ``BlockRemoved`` STORAGE from :meth:`KVTiers.poll`, which the
scheduler calls on the engine thread each step -- never from the writer thread. A block
the writer's full queue refuses is dropped unannounced (lost, recomputed if asked again).

Invariants:
- ``device_meta`` holds an entry for each hash cached in the device pool (parent, tokens,
  adapter: what a lower tier's events need), nothing else;
- ``host`` holds at most ``host_capacity`` blocks, ``disk`` at most ``kv_disk_bytes``
  (writes still pending counted); ``host`` and ``disk_meta`` are LRU in iteration order;
  ``disk_meta``'s keys are ``disk``'s (a failed write leaves both at the next poll);
- every lower-tier entry was published with a ``BlockStored`` of its medium and not yet
  with a ``BlockRemoved``; a hash may sit in both lower tiers (a disk copy outlives the
  block's return to the device and its next eviction to the host), each published apart;
- the loader thread reads host copies and the disk bytes the fetcher read for its job (it
  opens no file), and writes only the device blocks of its job, which the scheduler holds
  (refcount > 0, no hash) until the job lands, and the digest of host entries it seals
  (queued at copy-out; a load queued meanwhile goes first and seals what it reads);
- the disk writer thread touches only files and its own queue (see :mod:`.kv_disk_writer`);
  the disk fetcher and its readers touch only files, the writer's pending bytes and the
  ``fetched`` list of the job in hand; every tier structure here, and every event, is the
  engine thread's;
- ``disk`` is None once the tier is off (never configured, or its folder was lost); then
  ``disk_meta`` is empty.

The records (:class:`BlockMeta`, :class:`HostEntry`, :class:`LoadJob`) are
:mod:`.tier_entries`; the device copies and the loader thread, :mod:`.tier_loader`.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvroute.events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, to_external
from kvroute.events.kv_transfer import MEDIUM_REMOTE, KVSource
from kvroute.events.load import DISK_NONE, DISK_OFF, DISK_OK, DISK_UNRESPONSIVE

from .disk import DiskStore
from .disk_reads import READ_DEADLINE_S, DiskFetcher, DiskReads
from .disk_writer import DEFAULT_QUEUE_BYTES, DiskWriter
from .tier_costs import measure_tiers
from .tier_entries import BlockMeta, HostEntry, LoadJob
from .tier_loader import LOAD, SEAL, STAGE_BYTES, STOP, TierLoader, byte_rows

if TYPE_CHECKING:
    from ..core.block_pool import BlockPool
    from ..kv_transfer.fetcher import KVLink

__all__ = ["BlockMeta", "HostEntry", "KVTiers", "LoadJob"]

log = logging.getLogger(__name__)

CLOSE_WAIT_S = 5.0  # how long close() waits for the loader's job in hand


class KVTiers(TierLoader):
    """The host and disk tiers of one engine, and the thread that loads from them."""

    def __init__(
        self,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        host_bytes: int = 0,
        disk_path: str | None = None,
        disk_bytes: int = 0,
        disk_queue_bytes: int = DEFAULT_QUEUE_BYTES,
        disk_encrypt: bool = False,
        disk_read_timeout_s: float = READ_DEADLINE_S,
        measure: bool = True,
        link: KVLink | None = None,
    ) -> None:
        if host_bytes < 0 or disk_bytes < 0:
            raise ValueError("kv_host_bytes and kv_disk_bytes must be >= 0")
        if (disk_path is None) != (disk_bytes == 0):
            raise ValueError("kv_disk_path and kv_disk_bytes go together")
        self.tensors = [t for kv in kv_caches for t in kv]
        self.device = self.tensors[0].device
        self.cuda = self.device.type == "cuda"
        self.sizes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.block_bytes = sum(self.sizes)
        self._rows = [byte_rows(t) for t in self.tensors]
        self._chunk_blocks = max(1, STAGE_BYTES // self.block_bytes)
        staged = self._chunk_blocks if self.cuda else 0  # the CPU copies each block in place
        self._stage = torch.empty((staged, self.block_bytes), dtype=torch.uint8, device=self.device)
        self.host_capacity = host_bytes // self.block_bytes
        if host_bytes and not self.host_capacity:
            raise ValueError(f"kv_host_bytes {host_bytes} holds no block of {self.block_bytes}")
        self.host: OrderedDict[bytes, HostEntry] = OrderedDict()
        self.disk: DiskWriter | None = None
        self.disk_reads: DiskReads | None = None
        self._fetcher: DiskFetcher | None = None
        if disk_path is not None:
            store = DiskStore(disk_path, disk_bytes, encrypt=disk_encrypt)
            self.disk = DiskWriter(store, disk_queue_bytes)
            self.disk_reads = DiskReads(lambda h, n: store.read(h, n), disk_read_timeout_s)
            self._fetcher = DiskFetcher(self.disk, self.disk_reads, self.block_bytes, self._hand)
        self.disk_meta: OrderedDict[bytes, BlockMeta] = OrderedDict()
        self.device_meta: dict[bytes, BlockMeta] = {}
        self.remote: RemoteFetcher | None = None
        if link is not None:  # blocks pulled from other replicas (kv_transfer)
            from ..kv_transfer.fetcher import RemoteFetcher

            self.remote = RemoteFetcher(link, self.block_bytes, self._hand)
        self.pool: BlockPool | None = None  # set by attach
        self.stats = {
            "offloaded": 0,
            "spilled": 0,
            "loaded": 0,
            "load_failures": 0,
            "disk_dropped": 0,  # refused by the writer's full queue
            "disk_write_failures": 0,
            "disk_folder_lost": 0,  # 1 once the folder was deleted or replaced (tier off)
        }
        self.offload_seconds = 0.0
        self.bytes_per_s: dict[str, float] = measure_tiers(self) if measure else {}
        # (LOAD, STOP or SEAL, order queued, job): in that order, then first queued first.
        self._jobs: queue.PriorityQueue[tuple[int, int, LoadJob | HostEntry | None]] = (
            queue.PriorityQueue()
        )
        self._queued = itertools.count()
        self._done: list[LoadJob] = []
        self._done_lock = threading.Lock()
        self._wake = threading.Event()
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._thread = threading.Thread(target=self._run, name="kv-tier-loader", daemon=True)
        self._thread.start()

    def attach(self, pool: BlockPool) -> None:
        """Hooks into the device pool: its caching, evictions and resets reach the tiers."""
        self.pool = pool
        pool.tiers = self

    # -- the device pool's hooks (engine thread) ----------------------------------------
    def on_cached(
        self,
        hashes: Sequence[bytes],
        parent: bytes | None,
        token_ids: Sequence[int],
        block_size: int,
        lora_name: str | None,
    ) -> None:
        """Blocks just cached on the device: remembers what their events would say."""
        if not self.host_capacity and self.disk is None:
            return  # no lower tier to evict them to (remote loads only)
        meta = self.device_meta
        for i, h in enumerate(hashes):
            toks = tuple(int(t) for t in token_ids[i * block_size : (i + 1) * block_size])
            meta[h] = BlockMeta(parent if i == 0 else hashes[i - 1], toks, lora_name)

    def offload(self, evicted: Sequence[tuple[int, bytes]]) -> None:
        """Copies each evicted block (id, hash) down a tier before its new owner writes it.
        A hash another device copy still holds stays; one a lower tier has is touched."""
        pool = self.pool
        assert pool is not None
        t0 = time.perf_counter()
        down: list[tuple[int, bytes, BlockMeta]] = []  # what goes down a tier, in order
        for block_id, h in evicted:
            if pool.get_cached_block(h) is not None:
                continue  # another physical copy still serves it
            meta = self.device_meta.pop(h, None)
            if meta is None:
                continue
            if h in self.host:
                self.host.move_to_end(h)
                continue
            if h in self.disk_meta and not self.host_capacity:
                self.disk_meta.move_to_end(h)
                self.disk.touch(h)  # type: ignore[union-attr]
                continue
            if not self.host_capacity and self.disk is None:
                continue
            down.append((block_id, h, meta))
        # A chunk's copies, then its puts: the host entries those evict free their pinned
        # buffers for the next chunk's copies (all copies first would pin memory afresh).
        for first in range(0, len(down), self._chunk_blocks):
            chunk = down[first : first + self._chunk_blocks]
            copies = self._copy_out_blocks([block_id for block_id, _, _ in chunk])
            for (_, h, meta), (data, ready) in zip(chunk, copies, strict=True):
                entry = HostEntry(data, meta, ready)
                self.stats["offloaded"] += 1
                if self.host_capacity:
                    self._host_put(h, entry)
                    self._jobs.put((SEAL, next(self._queued), entry))  # sealed off the step
                else:
                    self._disk_put(h, data, entry.seal(), meta)
        self.offload_seconds += time.perf_counter() - t0

    def clear(self) -> None:
        """After the pool's ``AllBlocksCleared``: every tier forgets (the event says so)."""
        self.host.clear()
        self.disk_meta.clear()
        self.device_meta.clear()
        if self.disk is not None:
            self.disk.clear()

    # -- lookups and loads (engine thread) ----------------------------------------------
    def lookup(self, hashes: Sequence[bytes], start: int, stop: int) -> list[str]:
        """The media of the run of blocks ``hashes[start:stop]`` the lower tiers hold,
        stopping at the first they lack."""
        out: list[str] = []
        on_disk = self.disk_meta if self.disk_reads and not self.disk_reads.unresponsive else ()
        for h in hashes[start:stop]:
            if h in self.host:
                out.append(MEDIUM_CPU)
            elif h in on_disk:
                out.append(MEDIUM_STORAGE)
            else:
                break
        return out

    def prepare(
        self,
        request_id: str,
        hashes: Sequence[bytes],
        start: int = 0,
        num_remote: int = 0,
        source: KVSource | None = None,
    ) -> LoadJob:
        """A load of ``hashes`` (chain positions ``start`` on; all but the last
        ``num_remote`` found by :meth:`lookup`, those pulled from ``source``), their host
        copies taken now: the device blocks it needs are allocated next, and the evictions
        that makes may push these very blocks down a tier. Each is touched (most recently
        used)."""
        media, entries = [], []
        num_local = len(hashes) - num_remote
        for h in hashes[:num_local]:
            entry = self.host.get(h)
            if entry is not None:
                self.host.move_to_end(h)
                media.append(MEDIUM_CPU)
            else:
                self.disk_meta.move_to_end(h)
                self.disk.touch(h)  # type: ignore[union-attr]
                media.append(MEDIUM_STORAGE)
            entries.append(entry)
        media += [MEDIUM_REMOTE] * num_remote
        entries += [None] * num_remote
        job = LoadJob(request_id, [], media, list(hashes), entries, start=start)
        job.source = source if num_remote else None
        return job

    def start(self, job: LoadJob, block_ids: Sequence[int]) -> None:
        """Hands a prepared job to the loader thread, into these (held) device blocks."""
        job.block_ids = list(block_ids)
        if self.cuda:  # copy-outs of these blocks enqueued on the step's stream go first
            job.after = torch.cuda.Event()
            job.after.record()
        job.fetched = [None] * len(job.hashes)
        if self._fetcher is not None and MEDIUM_STORAGE in job.media:
            self._fetcher.submit(job)  # its disk blocks first, then its remote ones
        else:
            self._hand(job)

    def _hand(self, job: LoadJob) -> None:
        """A job whose disk blocks were read (by the disk fetcher, if it had any): its
        remote blocks are pulled next, if it has any, then on to the loader."""
        if job.source is not None and self.remote is not None:
            self.remote.submit(job)  # hands it back here, its source cleared
            return
        self._jobs.put((LOAD, next(self._queued), job))

    def release_remote(self, source: KVSource) -> None:
        """A request with a source that will not pull from it: its lease is freed."""
        if self.remote is not None:
            self.remote.release(source)

    def keep_remote(self, source: KVSource, extend_s: float) -> None:
        """A request still waiting to pull from ``source``: its lease there is extended (a
        message that never blocks: a source that is gone lets the lease lapse)."""
        if self.remote is not None:
            self.remote.link.keep(source, extend_s)

    def poll(self) -> None:
        """Announces the disk writes that failed since the last call (engine thread, each
        step): they leave the tier with a ``BlockRemoved`` STORAGE, in order with the rest;
        and turns the disk tier off once its folder is lost."""
        if self.disk is None:
            return
        if self.disk.lost is not None:
            self._disk_off(self.disk.lost)
            return
        failed = [h for h in self.disk.poll() if self.disk_meta.pop(h, None) is not None]
        if failed:
            self.stats["disk_write_failures"] += len(failed)
            self._emit(BlockRemoved([self._ext(h) for h in failed], MEDIUM_STORAGE))

    def _disk_off(self, why: str) -> None:
        """The folder was deleted or replaced: the tier stops, says so once, and withdraws
        what it held (a router must not credit blocks no load can bring back)."""
        assert self.disk is not None
        held, path = list(self.disk_meta), self.disk.path
        log.warning(
            "KV disk tier off: its folder %s was %s; %d blocks withdrawn", path, why, len(held)
        )
        self.stats["disk_folder_lost"] = 1
        self.disk_meta.clear()
        if held:
            self._emit(BlockRemoved([self._ext(h) for h in held], MEDIUM_STORAGE))
        self.disk.clear()
        self.disk.close()
        self.disk = None
        self.bytes_per_s.pop(MEDIUM_STORAGE, None)

    def disk_state(self) -> tuple[int, int]:
        """The disk tier's state (``events.load.DISK_*``) and its reads past their deadline,
        for the load report (and so the router's /metrics)."""
        reads = self.disk_reads
        if reads is None:
            return DISK_NONE, 0
        if self.disk is None:
            return DISK_OFF, reads.timeouts
        return (DISK_UNRESPONSIVE if reads.unresponsive else DISK_OK), reads.timeouts

    def counters(self) -> dict[str, int]:
        """``stats`` and the disk's live figures: what the engine's stats and load report
        carry (and the router's /metrics)."""
        out = dict(self.stats)
        reads = self.disk_reads
        if reads is not None:
            store = self._fetcher.disk.store  # type: ignore[union-attr]
            out["disk_read_timeouts"] = reads.timeouts
            out["disk_readers_stuck"] = reads.stuck
            out["disk_unresponsive"] = int(reads.unresponsive)
            out["disk_refused_files"] = store.num_refused  # FIFOs, devices: never opened
            out["disk_unauthentic"] = store.num_unauthentic  # failed authentication
        return out

    def take_done(self) -> list[LoadJob]:
        """Loads that landed since the last call, each exactly once."""
        if not self._wake.is_set():
            return []
        with self._done_lock:
            done, self._done = self._done, []
            self._wake.clear()
        for job in done:
            self.stats["loaded"] += job.num_ok
            if job.failed is not None:
                self.stats["load_failures"] += 1
                self.discard(job.failed)
        return done

    def wait(self, timeout: float) -> None:
        """Blocks until a load lands or ``timeout`` passes (an engine with nothing else)."""
        self._wake.wait(timeout)

    def discard(self, h: bytes) -> None:
        """Drops a copy that failed to load, from whichever tier has it."""
        if self.host.pop(h, None) is not None:
            self._emit(BlockRemoved([self._ext(h)], MEDIUM_CPU))
        elif self.disk_meta.pop(h, None) is not None:
            self.disk.discard(h)  # type: ignore[union-attr]
            self._emit(BlockRemoved([self._ext(h)], MEDIUM_STORAGE))

    def close(self) -> None:
        """Stops the loader, the disk reads and the disk writer (its writes not yet started
        are dropped; its files and folder are removed: tenants' data ends with the engine)."""
        self._jobs.put((STOP, next(self._queued), None))
        if self._fetcher is not None:
            self._fetcher.close()
        if self.remote is not None:
            self.remote.close()
        if self.disk is not None:
            self.disk.close()
        # Its load in hand finishes first: a process that exits while the thread is inside
        # a CUDA call aborts ("terminate called without an active exception").
        self._thread.join(CLOSE_WAIT_S)

    # -- tiers ------------------------------------------------------------------------
    def _host_put(self, h: bytes, entry: HostEntry) -> None:
        while len(self.host) >= self.host_capacity:
            old, e = self.host.popitem(last=False)
            self._emit(BlockRemoved([self._ext(old)], MEDIUM_CPU))
            if self.disk is not None and old not in self.disk_meta:
                self.stats["spilled"] += 1
                self._disk_put(old, e.data, e.seal(), e.meta)
        self.host[h] = entry
        self._emit(self._stored(h, entry.meta, MEDIUM_CPU))

    def _disk_put(self, h: bytes, data: torch.Tensor, digest: int, meta: BlockMeta) -> None:
        assert self.disk is not None
        evicted = self.disk.put(h, memoryview(data.numpy()), digest)  # queued, not written
        if evicted is None:
            self.stats["disk_dropped"] += 1
            return  # not kept (too large, or the writer's queue full): lost, not wrong
        for old in evicted:
            self.disk_meta.pop(old, None)
        if evicted:
            self._emit(BlockRemoved([self._ext(o) for o in evicted], MEDIUM_STORAGE))
        if h in self.disk_meta:
            self.disk_meta.move_to_end(h)
            return
        self.disk_meta[h] = meta
        self._emit(self._stored(h, meta, MEDIUM_STORAGE))

    def _stored(self, h: bytes, meta: BlockMeta, medium: str) -> BlockStored:
        return BlockStored(
            block_hashes=[self._ext(h)],
            parent_block_hash=self._ext(meta.parent) if meta.parent is not None else None,
            token_ids=list(meta.token_ids),
            block_size=len(meta.token_ids),
            lora_id=None,
            medium=medium,
            lora_name=meta.lora_name,
        )

    def _ext(self, h: bytes) -> object:
        assert self.pool is not None
        return to_external(h, self.pool.hash_form)

    def _emit(self, event: BlockStored | BlockRemoved) -> None:
        assert self.pool is not None
        self.pool.emit(event)
