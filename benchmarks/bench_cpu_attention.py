"""CPU paged attention, the C kernels beside the torch path, side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/bench_cpu_attention.py [--layers 30] [--repeat 3]
    python benchmarks/bench_cpu_attention.py --threads 2     # the C kernels, 1 thread vs 2

SmolLM2-135M's attention shapes (9 heads, 3 KV heads, head_dim 64), 32-token blocks
shuffled over a cache twice the needed size, one distinct cache per layer (so a step reads
K/V from memory, as a model's step does), fp32. Each case times every layer's attention
for one step of the batch, in CPU time of this process:

* prefill: sequences of n new tokens (causal), and chunks of 64 new tokens over a cached
  prefix; ``torch`` is SDPA on a gathered copy (kvroute's path before the C prefill
  kernel, ``KVROUTE_CPU_PREFILL_KERNEL=0``), ``C`` the kernel reading the cache in place;
* decode: one new token per sequence; ``torch`` is the reference's gathered, padded SDPA
  (``KVROUTE_CPU_DECODE_KERNEL=0``), ``C`` the decode kernel.

Useful GFLOP/s counts the score and value products the causal mask leaves (4 x heads x
head_dim per query-key pair seen).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from kvroute.kernels import AttentionMetadata, cpu

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 32
SCALE = HEAD_DIM**-0.5


def _case(layers: int, specs: list[tuple[int, int]], seed: int = 0):  # type: ignore[no-untyped-def]
    """(query, caches per layer, the step's metadata, query-key pairs seen) for (cached, new)
    specs."""
    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in specs]
    per = [-(-s // BLOCK) for s in lens]
    num_blocks = 2 * sum(per)
    caches = [
        (
            torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g),
            torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g),
        )
        for _ in range(layers)
    ]
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(specs), max(per), dtype=torch.int32)
    at = 0
    for i, p in enumerate(per):
        tables[i, :p] = perm[at : at + p].to(torch.int32)
        at += p
    new = [n for _, n in specs]
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(new), HEADS, HEAD_DIM, generator=g)
    meta = AttentionMetadata.of(
        tables,
        torch.tensor(lens, dtype=torch.int32),
        qsl,
        max_query_len=max(new),
        max_seq_len=max(lens),
    )
    pairs = sum(sum(c + i + 1 for i in range(n)) for c, n in specs)
    return query, caches, meta, pairs


def _time(
    query, caches, meta, repeat: int, clock=time.process_time, **switches
) -> tuple[float, torch.Tensor]:  # type: ignore[no-untyped-def]
    """``switches``: cpu.paged_attention's ``decode_kernel`` / ``prefill_kernel``."""
    out = None
    for k, v in caches:  # warm-up: plans, allocator
        out = cpu.paged_attention(query, k, v, meta, scale=SCALE, **switches)
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        for k, v in caches:
            out = cpu.paged_attention(query, k, v, meta, scale=SCALE, **switches)
        best = min(best, clock() - t0)
    assert out is not None
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--threads", type=int, default=0,
        help="instead: the C kernels on one thread against this many (wall time)",
    )  # fmt: skip
    args = ap.parse_args()
    if not (cpu.decode_kernel_available() and cpu.prefill_kernel_available()):
        raise SystemExit("the C kernels are not built in this install")
    cases = [
        ("prefill", "8 x 128 new", [(0, 128)] * 8),
        ("prefill", "8 x 320 new", [(0, 320)] * 8),
        ("prefill", "2 x 1024 new", [(0, 1024)] * 2),
        ("prefill", "8 x (256 cached + 64 new)", [(256, 64)] * 8),
        ("decode", "8 x 370", [(369, 1)] * 8),
        ("decode", "32 x 512", [(511, 1)] * 32),
    ]
    if args.threads:
        threads(args, cases)
        return
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s), {args.layers} layers, "
        f"heads {HEADS}/{KV_HEADS}/{HEAD_DIM}, block {BLOCK}, fp32, CPU time, best of {args.repeat}"
    )
    print("| kind | batch | torch ms | C ms | C vs torch | C useful GFLOP/s | max abs diff |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for kind, name, specs in cases:
        query, caches, meta, pairs = _case(args.layers, specs)
        off = {"prefill_kernel" if kind == "prefill" else "decode_kernel": False}
        slow, want = _time(query, caches, meta, args.repeat, **off)
        fast, got = _time(query, caches, meta, args.repeat)
        flops = 4 * HEADS * HEAD_DIM * pairs * args.layers
        diff = (got - want).abs().max().item()
        print(
            f"| {kind} | {name} | {slow * 1e3:,.1f} | {fast * 1e3:,.1f} | {slow / fast:.2f}x "
            f"| {flops / fast / 1e9:.1f} | {diff:.1e} |"
        )


def threads(args: argparse.Namespace, cases: list) -> None:  # type: ignore[type-arg]
    """The C kernels on one thread and on ``--threads`` (runs of sequences at once,
    kernels/cpu.py), wall time, best of ``--repeat``; outputs compared bit for bit."""
    n = args.threads
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{args.layers} layers, heads {HEADS}/{KV_HEADS}/{HEAD_DIM}, block {BLOCK}, fp32, "
        f"wall time, best of {args.repeat}, {os.cpu_count()} CPUs"
    )
    print(f"| kind | batch | 1 thread ms | {n} threads ms | speed-up | outputs equal |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for kind, name, specs in cases:
        query, caches, meta, _ = _case(args.layers, specs)
        torch.set_num_threads(1)
        one, want = _time(query, caches, meta, args.repeat, time.perf_counter)
        torch.set_num_threads(n)
        many, got = _time(query, caches, meta, args.repeat, time.perf_counter)
        print(
            f"| {kind} | {name} | {one * 1e3:,.1f} | {many * 1e3:,.1f} | {one / many:.2f}x "
            f"| {torch.equal(got, want)} |"
        )


if __name__ == "__main__":
    main()
