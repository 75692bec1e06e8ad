"""The transfer plane's loopback speed against recomputing the same prompt (issue 51, S2).

    python benchmarks/bench_kv_transfer.py

Two processes (not threads: one process's two Python threads would share one GIL, which two
replicas never do): a source (this script with ``--serve``) holds a KV cache of plain
tensors in a model's block shape, a lease on its blocks over a real BlockPool (no model),
and KVPlaneServers in front of its KVSender; this process pulls the lease through a
PlaneLink, checking each block's size and xxh3-64 as RemoteFetcher's sink does. Shapes:
smollm2-135m (30 layers x 3 KV heads x 64 x fp32 x K and V = 46,080 B/token, 737,280 B per
block of 16) and an 8B model (32 x 8 x 128 x bf16 x 2 = 2 MiB per block). Modes:

    zero-copy    the default: each block read into a pooled buffer of its own, sent with
                 copy=False, the buffer reused once ZeroMQ's tracker says it was sent;
                 the puller's sink keeps the received frame (PlaneLink.durable_blocks)
    copy         one reused buffer, each block copied into its ZeroMQ message
    zc+copyout   zero-copy, but the sink copies each block out (bytearray), as
                 RemoteFetcher did before durable_blocks

Per row: GB/s of a whole pull (``--blocks`` blocks, 64 MiB by default; best and median of
``--repeats``), per-block time at the median, a one-block pull's round trip, the xxh3-64's
share of the pull's wall time (one checksum on each side, timed alone on this CPU), CPU
time per block of the source process and of the puller (every thread: ZeroMQ's I/O threads
too). Beside them, the seconds 1k tokens take to pull and, for smollm2, to recompute (a
1024-token prefill of the real model on this CPU, the median of three after a warm-up;
``--no-recompute`` skips it). The table to stdout, JSON with ``--out``. The machine's load
average heads the table: on a shared machine, the spread between runs is large.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BS = 16
# name: (layers, KV heads, head_dim, dtype name, bytes per element)
SHAPES = {
    "smollm2-135m": (30, 3, 64, "float32", 4),
    "8B": (32, 8, 128, "bfloat16", 2),
}


def block_bytes(shape: str) -> int:
    layers, heads, dim, _, size = SHAPES[shape]
    return 2 * layers * heads * dim * size * BS


# -- the source process ----------------------------------------------------------------------
def serve(shape: str, num_blocks: int, device: str = "cpu") -> None:
    import torch

    from kvroute.replica.core.block_pool import BlockPool
    from kvroute.replica.kv_transfer.leases import Leases
    from kvroute.replica.kv_transfer.plane import KVPlaneServer
    from kvroute.replica.kv_transfer.sender import BlockReader, KVSender

    torch.set_num_threads(1)
    layers, heads, dim, dtype, _ = SHAPES[shape]
    kv = [
        tuple(
            torch.randn(num_blocks, BS, heads, dim).to(device=device, dtype=getattr(torch, dtype))
            for _ in range(2)
        )
        for _ in range(layers)
    ]
    pool = BlockPool(num_blocks, enable_kv_cache_events=False)
    blocks = pool.get_new_blocks(num_blocks)
    hashes = [i.to_bytes(16, "big") for i in range(1, num_blocks + 1)]
    pool.cache_full_blocks(blocks, hashes, 0, num_blocks, BS, [0] * (num_blocks * BS))
    leases = Leases(pool, lease_s=3600.0)
    lease = leases.grant("bench", blocks)
    sender = KVSender(leases, BlockReader(kv), "source")  # type: ignore[arg-type]
    servers = {m: KVPlaneServer(sender, zero_copy=m == "zero-copy") for m in ("copy", "zero-copy")}
    info = {
        "endpoints": {m: s.endpoint for m, s in servers.items()},
        "lease": lease.lease_id.hex(),
        "hashes": [h.hex() for h in hashes],
    }
    print(json.dumps(info), flush=True)
    while sys.stdin.readline().strip() == "cpu":  # until the puller is done
        print(time.process_time(), flush=True)  # every thread's, ZeroMQ's I/O thread too
    for s in servers.values():
        s.close()


# -- the puller --------------------------------------------------------------------------------
def checksum_s(nbytes: int) -> float:
    """One xxh3-64 of ``nbytes`` on this CPU (the best of five batches: the machine is shared)."""
    from kvroute.replica.kv_tiers.disk import checksum

    data = memoryview(os.urandom(nbytes))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(50):
            checksum(data)
        best = min(best, (time.perf_counter() - t0) / 50)
    return best


# mode: (the server's endpoint, whether the puller's sink keeps the frame or copies it out)
MODES = {
    "copy": ("copy", True),
    "zero-copy": ("zero-copy", True),
    "zc+copyout": ("zero-copy", False),  # the sink as it was: bytearray(data) per block
}


class Source:
    """The source process, and its CPU time on request."""

    def __init__(self, shape: str, blocks: int, device: str = "cpu") -> None:
        self.proc = subprocess.Popen(
            [
                *(sys.executable, __file__, "--serve", shape),
                *("--blocks", str(blocks), "--device", device),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.info = json.loads(self.stdout.readline())

    def cpu(self) -> float:
        self.stdin.write("cpu\n")
        self.stdin.flush()
        return float(self.stdout.readline())

    def close(self) -> None:
        self.stdin.write("\n")
        self.stdin.flush()
        self.proc.wait(10)


def measure(
    src: Source, mode: str, shape: str, blocks: int, repeats: int, device: str = "cpu"
) -> dict[str, Any]:
    from kvroute.events.kv_transfer import PULL_OK, KVSource
    from kvroute.replica.kv_tiers.disk import checksum
    from kvroute.replica.kv_transfer.plane import PlaneLink

    size = block_bytes(shape)
    server, keep = MODES[mode]
    hashes = [bytes.fromhex(h) for h in src.info["hashes"]]
    source = KVSource(
        replica_id="source",
        endpoint=src.info["endpoints"][server],
        lease=bytes.fromhex(src.info["lease"]),
        num_blocks=blocks,
    )
    link = PlaneLink()
    out: list[Any] = []
    landing = None
    if device != "cpu":  # each block lands in device memory, as the tiers' loader copies it
        import torch

        landing = torch.empty(size, dtype=torch.uint8, device=device)

    def sink(i: int, data: memoryview, digest: int) -> bool:  # RemoteFetcher's checks
        if len(data) != size or checksum(data) != digest:
            raise AssertionError(f"block {i} arrived wrong")
        if landing is not None:
            landing.copy_(torch.frombuffer(data, dtype=torch.uint8))
        out.append(data if keep else bytearray(data))
        return True

    def once(n: int) -> float:
        out.clear()
        t0 = time.perf_counter()
        got, reason = link.pull(source, 0, hashes[:n], sink, 30.0)
        seconds = time.perf_counter() - t0
        assert (got, reason) == (n, PULL_OK), (got, reason)
        return seconds

    once(blocks)  # warm: the connection, page faults
    cpu0, src0 = time.process_time(), src.cpu()
    whole = [once(blocks) for _ in range(repeats)]
    cpu1, src1 = time.process_time(), src.cpu()
    single = statistics.median(once(1) for _ in range(20))
    out.clear()
    link.close()
    n = repeats * blocks
    best, med = min(whole), statistics.median(whole)
    return {
        "shape": shape,
        "mode": mode,
        "block_bytes": size,
        "blocks": blocks,
        "gbps_best": blocks * size / best / 1e9,
        "gbps_median": blocks * size / med / 1e9,
        "per_block_ms": med / blocks * 1e3,
        "one_block_pull_ms": single * 1e3,
        "checksum_share": 2 * blocks * checksum_s(size) / med,
        "source_cpu_ms_per_block": (src1 - src0) / n * 1e3,
        "puller_cpu_ms_per_block": (cpu1 - cpu0) / n * 1e3,
        "pull_s_per_1k_tokens": med / (blocks * BS) * 1024,
    }


def pull_rows(shape: str, blocks: int, repeats: int, device: str = "cpu") -> list[dict[str, Any]]:
    src = Source(shape, blocks, device)
    try:
        return [measure(src, mode, shape, blocks, repeats, device) for mode in MODES]
    finally:
        src.close()


def recompute_s_per_1k() -> float:
    """One 1024-token prefill of smollm2-135m on this CPU (the median of three)."""
    import random

    from kvroute.replica import SamplingParams
    from kvroute.replica.engine.config import EngineConfig
    from kvroute.replica.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(model="smollm2-135m", num_blocks=256, enable_prefix_caching=False)
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)
    times = []
    for i in range(4):
        ids = [rng.randrange(100, 20000) for _ in range(1024)]
        engine.add_request(f"r{i}", ids, params)
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first warms up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--serve", choices=list(SHAPES), help=argparse.SUPPRESS)
    ap.add_argument("--blocks", type=int, default=0, help="blocks a pull (0: 64 MiB worth)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-recompute", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--device",
        default="cpu",
        help="cuda: the source's KV cache on the device (a pinned D2H per block) and each "
        "pulled block copied to the device (gpu_check.sh)",
    )
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.blocks, args.device)
        return
    rows = []
    for shape in args.shapes.split(","):
        blocks = args.blocks or (64 << 20) // block_bytes(shape)
        rows += pull_rows(shape, blocks, args.repeats, args.device)
    recompute = None if args.no_recompute else recompute_s_per_1k()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"# two processes over loopback TCP; {os.cpu_count()} CPUs, load average {load}")
    print(
        f"{'shape':<13} {'mode':<10} {'block B':>9} {'blocks':>6} {'GB/s best':>9} "
        f"{'GB/s med':>8} {'ms/block':>8} {'1-block ms':>10} {'xxh3 %':>6} "
        f"{'CPU ms/block src+dst':>20} {'pull s/1k':>9} {'recompute s/1k':>14}"
    )
    for r in rows:
        rec = recompute if r["shape"] == "smollm2-135m" and recompute is not None else None
        cpu = f"{r['source_cpu_ms_per_block']:.3f}+{r['puller_cpu_ms_per_block']:.3f}"
        print(
            f"{r['shape']:<13} {r['mode']:<10} {r['block_bytes']:>9,} {r['blocks']:>6} "
            f"{r['gbps_best']:>9.2f} {r['gbps_median']:>8.2f} {r['per_block_ms']:>8.3f} "
            f"{r['one_block_pull_ms']:>10.3f} {100 * r['checksum_share']:>6.1f} {cpu:>20} "
            f"{r['pull_s_per_1k_tokens']:>9.4f} {'-' if rec is None else f'{rec:.3f}':>14}"
        )
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "recompute_s_per_1k": recompute}, indent=1))


if __name__ == "__main__":
    main()
