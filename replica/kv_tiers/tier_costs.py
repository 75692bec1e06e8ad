"""What a load from each lower KV tier costs, measured once at start: the bandwidth
(bytes/s) the replica reports to routers in its cost coefficients, which price a
lower-tier hit at its load time (:mod:`.kv_tiers`, ``router/routing/policy.py``).

Why measure through the tier's own code: a disk load is a read, its authentication (the
files are sealed, :mod:`.seal`) and a copy into the device cache; timing a bare read
would price it too cheap. The probe is one 4 MiB copy per tier (a few ms); the disk's goes
through the store's write and the bounded read (:mod:`.kv_disk_reads`), so a probe file
that is not a regular one, or a disk that does not answer, leaves the disk unpriced
(routers then use a conservative default) instead of holding up the start.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from kvroute.events import MEDIUM_CPU, MEDIUM_STORAGE

from .disk import checksum

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

    def timed(t0: float) -> float:
        if cuda:
            torch.cuda.synchronize(device)
        return n / max(time.perf_counter() - t0, 1e-9)

    if tiers.host_capacity:
        t0 = time.perf_counter()
        checksum(src.numpy())
        dst.copy_(src, non_blocking=cuda)
        out[MEDIUM_CPU] = timed(t0)
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
