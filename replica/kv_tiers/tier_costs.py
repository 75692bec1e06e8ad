"""What a load from each lower KV tier costs, measured once at start: the bandwidth
(bytes/s) the replica reports to routers in its cost coefficients, which price a
lower-tier hit at its load time (:mod:`.kv_tiers`, ``router/routing/policy.py``).

Why measure through the tier's own code: a disk load is a read, its authentication (the
files are sealed, :mod:`.seal`) and a copy into the device cache; timing a bare read
would price it too cheap; and on CUDA a host load is bound by its scatter into each
layer's K and V as much as by the bus. The host probe is one load's chunk of blocks (4 MiB
on CPU, :data:`~.tier_loader.STAGE_BYTES` on CUDA; a few ms), the disk's one 4 MiB copy
through the store's write and the bounded read (:mod:`.kv_disk_reads`), so a probe file
that is not a regular one, or a disk that does not answer, leaves the disk unpriced
(routers then use a conservative default) instead of holding up the start.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvroute.events import MEDIUM_CPU, MEDIUM_STORAGE

from .disk import checksum
from .tier_loader import byte_rows

if TYPE_CHECKING:
    from .tiers import KVTiers

PROBE_BYTES = 4 << 20
_PROBE_HASH = b"\xff" * 16  # never a block's (a 128-bit hash), removed right after


def measure_tiers(tiers: KVTiers) -> dict[str, float]:
    """Load bandwidth into the device cache from each of ``tiers``' configured tiers."""
    n, cuda, device = PROBE_BYTES, tiers.cuda, tiers.device
    src = torch.randint(0, 255, (n,), dtype=torch.uint8)
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    out: dict[str, float] = {}
    if cuda:
        src = src.pin_memory()
    dst.copy_(src)  # warm

    def timed(t0: float, nbytes: int = n) -> float:
        if cuda:
            torch.cuda.synchronize(device)
        return nbytes / max(time.perf_counter() - t0, 1e-9)

    if tiers.host_capacity:
        out[MEDIUM_CPU] = _host_load(tiers, timed)
    if tiers.disk is not None and tiers.disk_reads is not None:
        store = tiers.disk.store
        if store.write_file(_PROBE_HASH, src.numpy(), checksum(src.numpy())):
            t0 = time.perf_counter()
            raw = tiers.disk_reads.read(_PROBE_HASH, n)
            if raw is not None:
                dst.copy_(torch.frombuffer(raw, dtype=torch.uint8))
                out[MEDIUM_STORAGE] = timed(t0)
            store.remove_file(_PROBE_HASH)
    return out


def _host_load(tiers: KVTiers, timed: Callable[[float, int], float]) -> float:
    """A load's bandwidth from host memory, through the loader's own checks and copies
    (:meth:`~.tier_loader.TierLoader._copy_in_blocks`) into a scratch copy of a chunk
    of blocks: on CUDA, what a block's layers cost to scatter is most of it."""
    k = tiers._chunk_blocks if tiers.cuda else max(1, PROBE_BYTES // tiers.block_bytes)
    scratch = [
        torch.empty((k, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in tiers.tensors
    ]
    rows = [byte_rows(t) for t in scratch]
    blocks = [torch.randint(0, 255, (tiers.block_bytes,), dtype=torch.uint8) for _ in range(k)]
    if tiers.cuda:
        blocks = [b.pin_memory() for b in blocks]
    ids = list(range(k))
    tiers._copy_in_blocks(ids, blocks, rows)  # warm (the scatter's kernels)
    timed(time.perf_counter(), 1)
    t0 = time.perf_counter()
    for b in blocks:
        checksum(b.numpy())
    tiers._copy_in_blocks(ids, blocks, rows)
    return timed(t0, k * tiers.block_bytes)
