"""A model's projections on one CPU thread: kvroute's tiled kernel beside oneDNN's prepacked
linear and plain ``F.linear``, in one run.

    OMP_NUM_THREADS=1 python benchmarks/bench_linear.py [--rows 1,8,32,512] [--layers 30]

The shapes are SmolLM2-135M's (hidden 576, 9 / 3 heads of 64, MLP 1,536): one layer's
fused QKV, O, fused gate-up and down projections, ``--layers`` distinct copies so that the
weights come from memory as in a real step, not from cache. Printed per row count: CPU
milliseconds for all layers' projections (process CPU time, best of ``--repeat``), the
weight bytes streamed per second, and GFLOP/s.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F  # noqa: N812

from kvroute.kernels import cpu_linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): QKV, O, gate-up, down


def forms() -> dict[str, object]:
    def tiled(w: torch.Tensor):  # type: ignore[no-untyped-def]
        packed, n = cpu_linear.pack(w), w.shape[0]
        return lambda x: cpu_linear.linear(x, packed, None, n)

    def onednn(w: torch.Tensor):  # type: ignore[no-untyped-def]
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def plain(w: torch.Tensor):  # type: ignore[no-untyped-def]
        return lambda x: F.linear(x, w)

    out: dict[str, object] = {"F.linear": plain}
    if torch.backends.mkldnn.is_available():
        out["oneDNN prepacked"] = onednn
    if cpu_linear.isa() is not None:
        out[f"kvroute tiled ({cpu_linear.isa()})"] = tiled
    return out


def measure(make, rows: int, layers: int, repeat: int) -> float:  # type: ignore[no-untyped-def]
    """CPU seconds for every layer's four projections of ``rows`` rows, best of ``repeat``."""
    g = torch.Generator().manual_seed(0)
    calls = []
    for out_f, in_f in SHAPES:
        x = torch.randn(rows, in_f, generator=g)
        for _ in range(layers):
            calls.append((make(torch.randn(out_f, in_f, generator=g) * 0.02), x))
    for f, x in calls:  # warm: allocator, first-call dispatch
        f(x)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        for f, x in calls:
            f(x)
        best = min(best, time.process_time() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,512")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"one thread (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), "
          f"{a.layers} layers of SmolLM2-135M's projections")  # fmt: skip
    weight_bytes = sum(o * i for o, i in SHAPES) * 4 * a.layers
    print("| rows | form | CPU ms | weights GB/s | GFLOP/s | vs oneDNN |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for rows in (int(r) for r in a.rows.split(",")):
        layers = a.layers if rows <= 64 else max(1, a.layers // 10)  # big rows: compute-bound
        scale = a.layers / layers
        times = {n: measure(make, rows, layers, a.repeat) * scale for n, make in forms().items()}
        base = times.get("oneDNN prepacked")
        for name, t in times.items():
            flops = 2 * rows * weight_bytes / 4
            vs = f"{base / t:.2f}x" if base else ""
            print(
                f"| {rows} | {name} | {t * 1e3:.1f} | {weight_bytes / t / 1e9:.1f} "
                f"| {flops / t / 1e9:.0f} | {vs} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
