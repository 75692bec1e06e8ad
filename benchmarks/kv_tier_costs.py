"""The in-process cost measurements of ``bench_kv_tier.py`` (``--copy-cost``, ``--disk-cost``).

Split out of ``benchmarks/bench_kv_tier.py``, which runs fleets over HTTP, so that script
reads as its fleet runs and this file as its micro-benchmarks: a block's copy out of and
back into the device cache (:func:`copy_cost`), the disk tier's write, read and AES-GCM
costs per block (:func:`disk_cost`), and a run of blocks loaded through the engine's own
path, plain and sealed (:func:`run_cost`). The command stays ``python
benchmarks/bench_kv_tier.py --copy-cost`` or ``--disk-cost`` (its docstring says what
each prints).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["copy_cost", "disk_cost", "run_cost", "say"]


def say(msg: str) -> None:
    print(f"bench_kv_tier: {msg}", file=sys.stderr, flush=True)


def copy_cost(blocks: int = 64) -> None:
    """What a copy-out at eviction costs per block: the engine thread's part (copy, host LRU
    insert) in its own CPU time, and with the checksum the loader thread adds, in the
    process's; and what a host load costs (verify, copy in), beside a bare clone of the same
    bytes: tiny's block and an 8B model's (32 layers, 8 KV heads of 128, bf16)."""
    import torch

    from kvroute.events import BlockStored
    from kvroute.replica.core.block_pool import BlockPool
    from kvroute.replica.kv_tiers.tiers import KVTiers

    print("| shape | block bytes | copy-out, engine thread us/block | with its xxh3 (loader "
          "thread) us/block | host load us/block | clone us/block |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, layers, heads, dim, dtype in (
        ("tiny fp32", 4, 4, 32, torch.float32),
        ("8B bf16", 32, 8, 128, torch.bfloat16),
    ):
        shape = (blocks * 2, 16, heads, dim)
        kv = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(layers)]
        tiers = KVTiers(kv, host_bytes=1 << 40, measure=False)
        pool = BlockPool(blocks * 2)
        tiers.attach(pool)
        hashes = [i.to_bytes(16, "big") for i in range(blocks)]
        for hsh in hashes:
            tiers.on_cached([hsh], None, list(range(16)), 16, None)
        pool.take_events()
        t0, p0 = time.thread_time(), time.process_time()
        tiers.offload(list(enumerate(hashes)))
        out_us = (time.thread_time() - t0) / blocks * 1e6  # the engine thread's part
        while any(e.digest is None for e in tiers.host.values()):
            time.sleep(0.001)  # the loader thread checksums each copy
        sealed_us = (time.process_time() - p0) / blocks * 1e6
        assert isinstance(pool.take_events()[0], BlockStored)
        job = tiers.prepare("x", hashes)
        t0 = time.process_time()
        tiers.start(job, range(blocks, 2 * blocks))
        job.done.wait()
        load_us = job.seconds / blocks * 1e6
        t0 = time.process_time()
        for i in range(blocks):
            torch.cat([t[i].reshape(-1).view(torch.uint8) for pair in kv for t in pair])
        clone_us = (time.process_time() - t0) / blocks * 1e6
        assert job.num_ok == blocks
        print(f"| {name} | {tiers.block_bytes:,} | {out_us:.0f} | {sealed_us:.0f} | "
              f"{load_us:.0f} | {clone_us:.0f} |")  # fmt: skip
        tiers.close()


def disk_cost(root: Path, rounds: int = 7) -> None:
    """Per block, in the thread's CPU microseconds (the least of ``rounds`` passes: the
    pass others' work disturbed least): a disk write and a disk load, plain and sealed,
    and AES-GCM's part of each (see the module doc). Cold loads are timed in wall
    microseconds (the read waits on the device)."""
    import torch

    from kvroute.replica.kv_tiers.disk import DiskStore, checksum
    from kvroute.replica.kv_tiers.seal import Sealer

    def per_block(fn: Any, n: int, clock: Any = time.thread_time) -> float:
        times = []
        for _ in range(rounds):
            t0 = clock()
            for i in range(n):
                fn(i)
            times.append((clock() - t0) / n * 1e6)
        return min(times)

    def drop_cache(store: DiskStore, n: int) -> None:
        for i in range(n):
            fd = os.open(store.file_of(i.to_bytes(16, "big")), os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)

    def shape_costs(name: str, size: int, n: int) -> None:
        blocks = [torch.randint(0, 256, (size,), dtype=torch.uint8).numpy() for _ in range(n)]
        keys = [i.to_bytes(16, "big") for i in range(n)]
        digests = [checksum(b) for b in blocks]
        cache = torch.empty(size, dtype=torch.uint8)
        sealer = Sealer()
        sealed = [sealer.seal(k, b) for k, b in zip(keys, blocks, strict=True)]
        seal_us = per_block(lambda i: sealer.seal(keys[i], blocks[i]), n)
        open_us = per_block(lambda i: sealer.open(keys[i], *sealed[i], size), n)
        for encrypt in (False, True):
            store = DiskStore(root, 1 << 40, encrypt=encrypt)

            def load(i: int, store: DiskStore = store) -> None:  # as KVTiers' loader does
                raw = store.read(keys[i], size)
                assert raw is not None
                cache.copy_(torch.frombuffer(raw, dtype=torch.uint8))

            write_us = per_block(lambda i, s=store: s.write_file(keys[i], blocks[i], digests[i]), n)
            warm_us = per_block(load, n)
            colds = []
            for _ in range(rounds):
                drop_cache(store, n)
                colds.append(per_block(load, n, time.perf_counter))
            cold_us = min(colds)
            store.close()
            aes = ("-", "-", "-")
            if encrypt:
                seal, opened = f"{seal_us:.0f} ({seal_us / write_us:.0%})", f"{open_us:.0f}"
                aes = (seal, f"{opened} ({open_us / warm_us:.0%})", f"{open_us / cold_us:.0%}")
            mode = "sealed" if encrypt else "plain"
            print(f"| {name} | {size:,} | {mode} | {write_us:.0f} | {aes[0]} | {warm_us:.0f} | "
                  f"{aes[1]} | {cold_us:.0f} | {aes[2]} |")  # fmt: skip

    say(f"disk cost under {root}: the least of {rounds} passes")
    print("| shape | block bytes | mode | write us | AES seal us (share) | load us, warm | "
          "AES open us (share) | load us, cold (wall) | open's share |")  # fmt: skip
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    shape_costs("tiny fp32", 4 * 2 * 16 * 4 * 32 * 4, 256)  # layers, K+V, tokens, heads, dim, fp32
    shape_costs("8B bf16", 32 * 2 * 16 * 8 * 128 * 2, 32)


def run_cost(root: Path, rounds: int = 7, blocks: int = 16) -> None:
    """A load of a run of ``blocks`` disk blocks (a returning conversation's prefix) through
    the engine's own path: ``KVTiers.start`` of a job whose blocks are all on disk, its
    fetch thread reading them through the bounded reads (pipelined: ``READ_AHEAD`` reads
    ahead of the block it opens) and the loader copying them into the cache. Per block:
    wall us to the fetcher's handoff and to the job landing, and the process's CPU us (every
    thread) to landing; plain and sealed side by side, also without read-ahead (``ahead
    0``: each block read, then opened, in turn) and with one more; warm, and cold after
    dropping the files' pages. The least of ``rounds`` passes each."""
    import numpy as np
    import torch

    from kvroute.events import MEDIUM_STORAGE
    from kvroute.replica.kv_tiers.disk import checksum
    from kvroute.replica.kv_tiers.disk_reads import READ_AHEAD
    from kvroute.replica.kv_tiers.tiers import KVTiers, LoadJob

    def drop_cache(store: Any, hashes: list[bytes]) -> None:
        for h in hashes:
            fd = os.open(store.file_of(h), os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)

    def one(tiers: KVTiers, hashes: list[bytes], tag: str) -> tuple[float, float, float]:
        fetcher = tiers._fetcher
        assert fetcher is not None
        handed: list[float] = []
        real = tiers._hand
        fetcher._handoff = lambda job: (handed.append(time.perf_counter()), real(job))
        n = len(hashes)
        job = LoadJob(tag, [], [MEDIUM_STORAGE] * n, list(hashes), [None] * n)
        c0, t0 = time.process_time(), time.perf_counter()
        tiers.start(job, list(range(n)))
        assert job.done.wait(60)
        t1, c1 = time.perf_counter(), time.process_time()
        fetcher._handoff = real
        assert job.num_ok == n, f"{tag}: {job.num_ok} of {n} loaded"
        return ((handed[0] - t0) / n * 1e6, (t1 - t0) / n * 1e6, (c1 - c0) / n * 1e6)

    def best(runs: list[tuple[float, float, float]]) -> list[float]:
        return [min(r[k] for r in runs) for k in range(3)]

    aheads = (0, READ_AHEAD, READ_AHEAD + 1)  # none (serial), the default, one more
    rows = []
    for name, layers, heads, dim, dtype in (
        ("tiny fp32", 4, 4, 32, torch.float32),
        ("8B bf16", 32, 8, 128, torch.bfloat16),
    ):
        shape = (blocks, 16, heads, dim)
        kv = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
              for _ in range(layers)]  # fmt: skip
        rng = np.random.default_rng(5)
        hashes = [(1000 + i).to_bytes(16, "big") for i in range(blocks)]
        both: dict[str, KVTiers] = {}
        for mode in ("plain", "sealed"):  # both at once: their passes alternate
            tiers = KVTiers(kv, disk_path=str(root / mode), disk_bytes=1 << 40,
                            disk_encrypt=mode == "sealed", measure=False)  # fmt: skip
            assert tiers.disk is not None and tiers._fetcher is not None
            size = tiers.block_bytes
            datas = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(blocks)]
            for h, d in zip(hashes, datas, strict=True):
                assert tiers.disk.store.write_file(h, d, checksum(d))
            one(tiers, hashes, "check")
            for i, d in enumerate(datas):  # the blocks landed whole, in their places
                got = torch.cat([t[i].reshape(-1).view(torch.uint8) for t in tiers.tensors])
                assert bytes(got.numpy()) == d.tobytes(), f"{name} {mode}: block {i} differs"
            both[mode] = tiers
        for temp in ("warm", "cold"):
            runs: dict[tuple[int, str], list[tuple[float, float, float]]] = {
                (a, m): [] for a in aheads for m in both
            }
            for _ in range(rounds):  # every variant in turn, each pass: drift hits them alike
                for ahead in aheads:
                    for mode, tiers in both.items():
                        tiers._fetcher.ahead = ahead  # type: ignore[union-attr]
                        if temp == "cold":
                            drop_cache(tiers.disk.store, hashes)  # type: ignore[union-attr]
                        runs[ahead, mode].append(one(tiers, hashes, temp))
            for ahead in aheads:
                plain, sealed = best(runs[ahead, "plain"]), best(runs[ahead, "sealed"])
                share = [(s - p) / s for p, s in zip(plain, sealed, strict=True)]
                med = [statistics.median(r[1] for r in runs[ahead, m]) for m in both]
                rows.append((name, size, ahead, temp, plain, sealed, share, med))
        for tiers in both.values():
            tiers.close()
    print(f"\nA load of a run of {blocks} disk blocks through KVTiers (fetch + loader copy), "
          f"per block, the least of {rounds} passes (every variant in turn, each pass); sealed "
          "share = (sealed - plain) / sealed")  # fmt: skip
    print("| shape | block bytes | read-ahead | page cache | fetched, wall us plain / sealed "
          "(share) | landed, wall us plain / sealed (share) | CPU us plain / sealed "
          "(share) | landed, median of passes |")  # fmt: skip
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for name, size, ahead, temp, plain, sealed, share, med in rows:
        cells = " | ".join(f"{plain[k]:.0f} / {sealed[k]:.0f} ({share[k]:.0%})" for k in range(3))
        print(f"| {name} | {size:,} | {ahead} | {temp} | {cells} | {med[0]:.0f} / {med[1]:.0f} |")
