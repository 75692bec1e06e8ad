"""Decode-only paged attention on CUDA: the Triton kernel's time per call and bandwidth.

    python benchmarks/bench_decode_bandwidth.py

One layer's decode step (one new token per sequence, every sequence at the same context),
bf16, block size 16, block tables shuffled over a cache twice the needed size, for three
head layouts (the tiny model's, SmolLM2-135M's, Llama-3-8B's) and three batch shapes.
Bytes are Q, K and V read once and the output written once. Two timings per case:

* wall: a host loop with a sync around each call (as bench_kernels.py times), so Python's
  launch overhead is in it;
* graph: 20 calls captured in one CUDA graph and replayed, timed by CUDA events: GPU time
  only, what the kernel costs once launches are off the critical path.

The first line is the card's device-to-device copy of 2 GiB (read + write), also replayed
from a graph, for scale. Needs CUDA and Triton.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

from kvroute.kernels import AttentionMetadata

BLOCK = 16
SHAPES = {  # name: (heads, KV heads, head_dim)
    "tiny 8/4/32": (8, 4, 32),
    "SmolLM2-135M 9/3/64": (9, 3, 64),
    "Llama-3-8B 32/8/128": (32, 8, 128),
}
BATCHES = ((64, 1100), (128, 4096), (256, 2048))  # (sequences, context tokens)


def make_case(heads: int, kv_heads: int, d: int, batch: int, ctx: int, dtype: torch.dtype):
    nb = -(-ctx // BLOCK)
    num_blocks = batch * nb * 2
    tables = torch.randperm(num_blocks)[: batch * nb].view(batch, nb).to(torch.int32)
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, d, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    query = torch.randn(batch, heads, d, dtype=dtype, device="cuda")
    meta = AttentionMetadata.of(
        tables.cuda(),
        torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
        torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        max_query_len=1,
        max_seq_len=ctx,
    )
    kwargs = {"meta": meta, "scale": d**-0.5}
    nbytes = k_cache.element_size() * (2 * batch * ctx * kv_heads * d + 2 * batch * heads * d)
    return query, k_cache, v_cache, kwargs, nbytes


def wall(fn: Callable[[], object], n: int = 50) -> float:
    """Median seconds per call, host-timed with a sync on each side, after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def graph(fn: Callable[[], object], calls: int = 20, reps: int = 10) -> float:
    """Median GPU seconds per call: ``calls`` calls in one CUDA graph, replayed ``reps`` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_decode_bandwidth.py needs CUDA (the Triton kernels run only there)")
    from kvroute.kernels import reference
    from kvroute.kernels import triton_kernels as tk

    torch.manual_seed(0)
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = graph(partial(dst.copy_, src), calls=5)
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; D2D copy 2 GiB: "
        f"{2 * src.numel() / copy_s / 1e9:.0f} GB/s (read+write)"
    )
    del src, dst
    print(
        "| shape (heads/KV heads/head_dim) | batch x context | KV+Q+out MB | wall ms | graph ms"
        " | GB/s (graph) | GB/s (wall) | max abs diff vs reference |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (heads, kv_heads, d) in SHAPES.items():
        for batch, ctx in BATCHES:
            q, kc, vc, kw, nbytes = make_case(heads, kv_heads, d, batch, ctx, torch.bfloat16)

            def fn(q=q, kc=kc, vc=vc, kw=kw) -> torch.Tensor:
                return tk.paged_attention(q, kc, vc, **kw)

            w, g = wall(fn), graph(fn)
            diff = ""
            if batch == 64:  # the reference is slow on the big cases; one check per shape
                want = reference.paged_attention(q, kc, vc, **kw)
                diff = f"{(fn().float() - want.float()).abs().max().item():.2e}"
            print(
                f"| {name} | {batch} x {ctx} | {nbytes / 1e6:.0f} | {w * 1e3:.3f} | "
                f"{g * 1e3:.3f} | {nbytes / g / 1e9:.0f} | {nbytes / w / 1e9:.0f} | {diff} |",
                flush=True,
            )
            del q, kc, vc, fn
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
