"""Paged attention speed: the torch reference (and Triton on CUDA) beside dense SDPA, one run.

    python benchmarks/bench_kernels.py [--repeat N] [--device cpu|cuda] [--dtype float32|bfloat16]

Shapes are one layer of the tiny engine model (8 heads, 4 KV heads, head_dim 32), block
size 16, blocks shuffled in a larger cache. The floor is ``scaled_dot_product_attention`` on
contiguous K/V already laid out and head-expanded for it (none of that is timed), with the
same masks: what attention costs with no paging at all. On CUDA the Triton kernels also run,
are checked against the reference, and their achieved memory bandwidth (bytes of Q, K, V
read and of the output written, once each, over time) is reported.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from types import ModuleType

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention as sdpa

from kvroute.kernels import AttentionMetadata, available_backends, reference

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 32, 16


def timeit(fn: Callable[[], object], repeat: int, cuda: bool) -> tuple[float, float]:
    """(median, best) seconds over ``repeat`` calls after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times)


class Case:
    """One batch: paged cache + metadata, and the same data laid out densely for the floor."""

    def __init__(
        self,
        name: str,
        specs: list[tuple[int, int]],
        dtype: torch.dtype,
        device: str,
        shared_tokens: int = 0,
    ) -> None:
        """``shared_tokens``: every sequence's table starts with the same physical blocks
        (siblings of one cached prefix, as prefix caching leaves them)."""
        g = torch.Generator().manual_seed(0)
        self.name, self.specs = name, specs
        seq_lens = [c + q for c, q in specs]
        nblocks = [-(-s // BLOCK) for s in seq_lens]
        num_shared = shared_tokens // BLOCK
        num_blocks = (sum(nblocks) - num_shared * (len(specs) - 1)) * 2  # half: nobody's
        perm = torch.randperm(num_blocks, generator=g)
        width, used = max(nblocks), num_shared
        tables = torch.zeros(len(specs), width, dtype=torch.int32)
        for i, n in enumerate(nblocks):
            tables[i, :num_shared] = perm[:num_shared]
            tables[i, num_shared:n] = perm[used : used + n - num_shared]
            used += n - num_shared
        shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        self.k_cache = torch.randn(shape, generator=g).to(dtype).to(device)
        self.v_cache = torch.randn(shape, generator=g).to(dtype).to(device)
        q_lens = [q for _, q in specs]
        self.num_tokens = sum(q_lens)
        self.query = torch.randn(self.num_tokens, HEADS, HEAD_DIM, generator=g).to(dtype)
        self.query = self.query.to(device)
        starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
        self.meta = AttentionMetadata.of(
            tables.to(device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device),
            starts.to(device),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
        )
        self.seq_lens, self.q_lens, self.tables = seq_lens, q_lens, tables
        self.dtype, self.device = dtype, device

    def dense_inputs(self, expand: bool) -> Callable[[], object]:
        """A closure running the floor: one SDPA per prefill, one padded SDPA for decodes.

        ``expand``: K/V repeated to every query head (torch's CPU flash kernel wants that)
        rather than left at the KV heads with ``enable_gqa`` (less to read).
        """
        calls: list[Callable[[], Tensor]] = []
        group = HEADS // KV_HEADS if expand else 1
        heads = KV_HEADS * group
        gqa = {} if expand else {"enable_gqa": True}

        def contiguous(cache: Tensor, i: int) -> Tensor:
            blocks = self.tables[i, : -(-self.seq_lens[i] // BLOCK)].long().to(self.device)
            kv = cache[blocks].flatten(0, 1)[: self.seq_lens[i]]  # [S, Hk, D]
            return kv.transpose(0, 1).repeat_interleave(group, 0).contiguous()  # [heads, S, D]

        decodes = [i for i, q in enumerate(self.q_lens) if q == 1]
        start = 0
        for i, q_len in enumerate(self.q_lens):
            if q_len > 1:
                s = self.seq_lens[i]
                # 4-D: torch's CPU flash kernel takes nothing else.
                q = self.query[start : start + q_len].transpose(0, 1).contiguous()[None]
                k, v = contiguous(self.k_cache, i)[None], contiguous(self.v_cache, i)[None]
                if q_len == s:
                    calls.append(lambda q=q, k=k, v=v: sdpa(q, k, v, is_causal=True, **gqa))
                else:
                    pos = torch.arange(s, device=self.device)
                    mask = pos[None, :] <= pos[s - q_len :, None]
                    calls.append(lambda q=q, k=k, v=v, m=mask: sdpa(q, k, v, attn_mask=m, **gqa))
            start += q_len
        if decodes:
            length = max(self.seq_lens[i] for i in decodes)
            shape = (len(decodes), heads, length, HEAD_DIM)
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v = torch.zeros_like(k)
            for j, i in enumerate(decodes):
                k[j, :, : self.seq_lens[i]] = contiguous(self.k_cache, i)
                v[j, :, : self.seq_lens[i]] = contiguous(self.v_cache, i)
            lens = torch.tensor([self.seq_lens[i] for i in decodes], device=self.device)
            mask = (torch.arange(length, device=self.device)[None, :] < lens[:, None])[
                :, None, None, :
            ]
            rows = torch.tensor([sum(self.q_lens[:i]) for i in decodes], device=self.device)
            q = self.query[rows][:, :, None, :]  # [B, H, 1, D]
            calls.append(lambda q=q, k=k, v=v, m=mask: sdpa(q, k, v, attn_mask=m, **gqa))
        return lambda: [c() for c in calls]

    def flops(self) -> int:
        """2 matmuls x 2 flops per multiply-add over every (query, visible key) pair."""
        lens = zip(self.seq_lens, self.q_lens, strict=True)
        pairs = sum(q * (s - q) + q * (q + 1) // 2 for s, q in lens)
        return 4 * pairs * HEADS * HEAD_DIM

    def bytes_moved(self) -> int:
        """Q read + K and V read once + output written: the memory-traffic lower bound."""
        elem = torch.empty(0, dtype=self.dtype).element_size()
        kv = sum(self.seq_lens) * KV_HEADS * HEAD_DIM * 2
        return elem * (kv + 2 * self.num_tokens * HEADS * HEAD_DIM)


def attention(backend: ModuleType, case: Case) -> Tensor:
    return backend.paged_attention(
        case.query, case.k_cache, case.v_cache, case.meta, scale=HEAD_DIM**-0.5
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--triton",
        action="store_true",
        help="run the Triton path off CUDA too (a smoke test under TRITON_INTERPRET=1)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    triton = None
    if (cuda and "triton" in available_backends()) or args.triton:
        from kvroute.kernels import triton_kernels as triton
    rng = torch.Generator().manual_seed(1)
    ctx = [1072 + int(x) for x in torch.randint(0, 64, (64,), generator=rng)]
    cases = [
        Case("prefill 2,048", [(0, 2048)], dtype, args.device),
        Case("32 new over 2,016 cached", [(2016, 32)], dtype, args.device),
        Case("decode x1 @ ~1,100", [(ctx[0] - 1, 1)], dtype, args.device),
        Case("decode x64 @ ~1,100", [(c - 1, 1) for c in ctx], dtype, args.device),
        Case(
            "decode x64 @ ~1,100, 1,024 shared",
            [(c - 1, 1) for c in ctx],
            dtype,
            args.device,
            shared_tokens=1024,
        ),
    ]
    dev_name = torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"
    print(
        f"# torch {torch.__version__}, {args.device} ({dev_name}), {dtype}, "
        f"threads {torch.get_num_threads()}, {HEADS} heads / {KV_HEADS} KV heads, "
        f"head_dim {HEAD_DIM}, block {BLOCK}; median (best) of {args.repeat}, ms per call"
    )
    header = "| case | reference | dense SDPA floor | reference / floor |"
    if triton is not None:
        header += " triton | triton GB/s | triton TFLOP/s | max abs diff vs reference |"
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for case in cases:
        ref = partial(attention, reference, case)
        r_med, r_best = timeit(ref, args.repeat, cuda)
        # The floor is the faster of the two dense layouts.
        floors = {
            name: timeit(case.dense_inputs(expand), args.repeat, cuda)
            for name, expand in (("expanded", True), ("gqa", False))
        }
        layout = min(floors, key=lambda n: floors[n][0])
        f_med, f_best = floors[layout]
        row = (
            f"| {case.name} | {r_med * 1e3:.3f} ({r_best * 1e3:.3f}) | "
            f"{f_med * 1e3:.3f} ({f_best * 1e3:.3f}) {layout} | {r_med / f_med:.2f}x |"
        )
        if triton is not None:
            tri = partial(attention, triton, case)
            t_med, t_best = timeit(tri, args.repeat, cuda)
            diff = (tri().float() - ref().float()).abs().max().item()
            gbps = case.bytes_moved() / t_med / 1e9
            tflops = case.flops() / t_med / 1e12
            row += (
                f" {t_med * 1e3:.3f} ({t_best * 1e3:.3f}) | {gbps:.0f} | {tflops:.2f} |"
                f" {diff:.2e} |"
            )
        print(row)
    # store_kv: one prefill's and one decode batch's worth of new tokens.
    case = cases[0]
    for n in (2048, 64):
        key = torch.randn(n, KV_HEADS, HEAD_DIM).to(dtype).to(args.device)
        slots = torch.randperm(case.k_cache.shape[0] * BLOCK)[:n].to(args.device)
        store = (key, key, case.k_cache, case.v_cache, slots)
        med, best = timeit(partial(reference.store_kv, *store), args.repeat, cuda)
        line = f"store_kv {n} tokens: reference {med * 1e3:.3f} ({best * 1e3:.3f}) ms"
        if triton is not None:
            t_med, _ = timeit(partial(triton.store_kv, *store), args.repeat, cuda)
            gbps = 4 * key.numel() * key.element_size() / t_med / 1e9
            line += f"; triton {t_med * 1e3:.3f} ms ({gbps:.0f} GB/s)"
        print(line)


if __name__ == "__main__":
    main()
