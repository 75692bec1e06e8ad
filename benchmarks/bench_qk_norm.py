"""Qwen3's q/k head norms and rotary on the CPU: the C layer ops beside the torch ops they
replace, one run.

    OMP_NUM_THREADS=1 python benchmarks/bench_qk_norm.py [--repeat 200]

Between its QKV projection and attention a Qwen3 layer normalizes each q and k head
(``q_norm``, ``k_norm``) and rotates them. The torch path (replica/model/decoder.py without the C
ops) is two fused RMSNorms, a concatenation and the half-split rotation, ~10 ops a layer;
the C path is two in-place passes (``rms_norm_heads_``) and the in-place rotary over the
QKV rows. Shapes: Qwen3-0.6B's attention (16 heads, 8 KV heads, head_dim 128; 28 layers),
per layer, fp32, rows = tokens in the step (decode batches and one prefill). CPU time per
call, median of 5 rounds of ``--repeat`` calls; outputs checked equal first.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F  # noqa: N812

from kvroute.kernels import cpu_ops

HEADS, KV_HEADS, HEAD_DIM, LAYERS, EPS = 16, 8, 128, 28, 1e-6


def torch_path(qkv: torch.Tensor, wq, wk, cos, sin) -> torch.Tensor:  # type: ignore[no-untyped-def]
    t, h, hk, d = qkv.shape[0], HEADS, KV_HEADS, HEAD_DIM
    q = F.rms_norm(qkv[:, : h * d].view(t, h, d), (d,), wq, EPS)
    k = F.rms_norm(qkv[:, h * d : (h + hk) * d].view(t, hk, d), (d,), wk, EPS)
    x = torch.cat((q, k), dim=1)
    half = d // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def c_path(qkv: torch.Tensor, wq, wk, cos, sin) -> torch.Tensor:  # type: ignore[no-untyped-def]
    h, hk, d = HEADS, KV_HEADS, HEAD_DIM
    cpu_ops.rms_norm_heads_(qkv, wq, h, d, EPS)
    cpu_ops.rms_norm_heads_(qkv[:, h * d :], wk, hk, d, EPS)
    cpu_ops.rotary_(qkv, cos, sin, h + hk, d)
    return qkv[:, : (h + hk) * d].view(qkv.shape[0], h + hk, d)


def cpu_us(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    rounds = []
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(repeat):
            fn()
        rounds.append((time.process_time() - t0) / repeat * 1e6)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    if not cpu_ops.usable(torch.device("cpu"), torch.float32):
        raise SystemExit("the C layer ops are not built")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    wq, wk = torch.randn(HEAD_DIM, generator=g), torch.randn(HEAD_DIM, generator=g)
    print(f"torch {torch.__version__}, 1 thread, Qwen3-0.6B attention shapes, {LAYERS} layers")
    print("| rows (tokens in the step) | torch us / layer | C us / layer | C vs torch | "
          "saved per step, 28 layers (ms) |")  # fmt: skip
    print("| ---: | ---: | ---: | ---: | ---: |")
    for rows in (1, 8, 32, 512):
        qkv = torch.randn(rows, width, generator=g) * 3
        freqs = torch.randn(rows, HEAD_DIM // 2, generator=g)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().contiguous(), emb.sin().contiguous()
        want = torch_path(qkv, wq, wk, cos, sin)
        got = c_path(qkv.clone(), wq, wk, cos, sin)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        reps = max(args.repeat // max(rows // 8, 1), 10)
        t_torch = cpu_us(partial(torch_path, qkv, wq, wk, cos, sin), reps)
        work = qkv.clone()  # the C path works in place: the same rows, normalized again
        t_c = cpu_us(partial(c_path, work, wq, wk, cos, sin), reps)
        print(f"| {rows} | {t_torch:.1f} | {t_c:.1f} | {t_torch / t_c:.2f}x | "
              f"{(t_torch - t_c) * LAYERS / 1000:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
