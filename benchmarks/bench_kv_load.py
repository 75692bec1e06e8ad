"""A prefix loaded back from the host KV tier against its recompute, and the decode steps
of other requests while it loads (issue 38's GPU goal; it runs on the CPU too).

    python benchmarks/bench_kv_load.py [--model tiny|llama-8b|PATH] [--prefix 2048]
        [--decoders 16] [--steps 20]

One engine (``LLMEngine``, prefix caching on) whose device pool holds the decoders'
contexts and about two prefixes, over a host tier of four prefixes. In order:

0. **warm-up**: another prompt of that length, twice: the second hits its prefix on the
   device (the floor a load approaches) and the shapes of a cached prefix's step are no
   longer first used (on a GPU, Triton compiles them) in the load's own step below;
1. **recompute**: a prompt of ``--prefix`` tokens, alone, on a cold cache: its TTFT;
2. other prompts of the same length push its blocks off the device into the host tier
   (checked by its first block's hash: gone from the device, present in the host tier);
3. **load**: the same prompt, alone: its TTFT, and the tokens each tier served;
4. **beside decodes**: ``--decoders`` sequences decode; ``--steps`` steps are timed as the
   baseline; the prompt's blocks are pushed to the host tier again (between decode steps)
   and the prompt arrives: every step until its first token is timed and marked whether
   the load ran during it (in flight at the step's start, or landed inside it) and
   whether the prompt computed in it (its uncached tail: that step also prefills).

The goal (8B shapes, bf16, a GPU): the load's TTFT <= 1/5 of the recompute's, and decode
steps during the load <= 1.05x the baseline's. ``llama-8b`` is bench_decode_step's folder of
Llama-3.1-8B layer shapes with random bf16 weights (written there on first use). Wall
times, the GPU synchronized; every figure is printed as a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_step import write_llama_8b

from kvroute.replica import EngineConfig, LLMEngine, SamplingParams
from kvroute.replica.model.models import resolve_model

CUDA = torch.cuda.is_available()
BLOCK = 16
DECODE_PROMPT = 256  # each decoder's prompt


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def ttft(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[float, dict[str, int], int]:
    """(seconds to its first token, tokens by lower tier, cached tokens) of one prompt
    alone; it is then run to its end (1 token)."""
    sync()
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1))
    while True:
        outs = engine.step()
        done = next((o for o in outs if o.request_id == rid and o.finished), None)
        if done is not None:
            sync()
            return (
                time.perf_counter() - t0,
                dict(done.num_tier_cached_tokens),
                done.num_cached_tokens,
            )


def push_to_host(engine: LLMEngine, prompt: list[int], rng: random.Random, vocab: int) -> int:
    """Runs other prompts of the same length until ``prompt``'s first block has left the
    device for the host tier; returns how many it took. Between decode steps when
    decoders run (each filler is admitted beside them)."""
    first = engine.hasher.hash_blocks(prompt)[0]
    pool, tiers = engine.kv_cache_manager.block_pool, engine.kv_tiers
    assert tiers is not None
    n = 0
    while pool.get_cached_block(first) is not None or first not in tiers.host:
        filler = [rng.randrange(3, vocab - 8) for _ in range(len(prompt))]
        rid = f"filler-{n}"
        engine.add_request(rid, filler, SamplingParams(temperature=0.0, max_tokens=1))
        while rid in engine.scheduler.requests:
            engine.step()
        n += 1
        if n > 64:
            raise RuntimeError("the prompt's blocks never left the device: pool too large?")
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny, llama-8b, or a model folder")
    ap.add_argument("--prefix", type=int, default=2048, help="the loaded prompt's tokens")
    ap.add_argument("--decoders", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20, help="baseline decode steps timed")
    args = ap.parse_args()
    model = args.model
    if model == "llama-8b":
        model = str(write_llama_8b(Path(tempfile.gettempdir()) / "kvroute-llama-8b-rand"))
    if not CUDA:
        torch.set_num_threads(1)
    ctx = DECODE_PROMPT + args.steps + 128  # a decoder's context, with room for fillers' steps
    blocks = (args.decoders * ctx + int(2.5 * args.prefix)) // BLOCK
    cfg = json.loads((resolve_model(model) / "config.json").read_text())  # not loaded twice
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    itemsize = 2 if CUDA else 4  # the engine's default dtype: bf16 on CUDA, fp32 on the CPU
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    block_bytes = cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * BLOCK * itemsize
    host = 4 * (args.prefix // BLOCK + 1) * block_bytes
    engine = LLMEngine(
        EngineConfig(
            model=model, block_size=BLOCK, num_blocks=blocks, kv_host_bytes=host,
            max_num_batched_tokens=max(2048, args.prefix + 64),
        )
    )  # fmt: skip
    assert engine.kv_tiers is not None and engine.kv_tiers.block_bytes == block_bytes
    vocab = engine.vocab_size
    device = "CUDA " + torch.cuda.get_device_name() if CUDA else "CPU, 1 thread"
    rates = {k: f"{v / 1e9:.1f} GB/s" for k, v in engine.kv_tiers.bytes_per_s.items()}
    print(f"{model}, {device}, {blocks} device blocks of {BLOCK}, {block_bytes / 2**20:.2f} "
          f"MiB a block, host tier {host / 2**30:.2f} GiB, load bandwidth {rates}")  # fmt: skip
    rng = random.Random(0)
    prompt = [rng.randrange(3, vocab - 8) for _ in range(args.prefix)]
    warm = [rng.randrange(3, vocab - 8) for _ in range(args.prefix)]
    ttft(engine, "warm", warm)  # the kernels' first use (Triton compiles) out of the figures:
    on_device, _, _ = ttft(engine, "warm-hit", warm)  # a whole prompt's, and a cached prefix's

    recompute, _, _ = ttft(engine, "recompute", prompt)
    fillers = push_to_host(engine, prompt, rng, vocab)
    loaded, tiers, cached = ttft(engine, "load", prompt)
    print("\n| prompt | TTFT ms | cached tokens (of them from the host tier) | vs recompute |")
    print("| --- | ---: | --- | ---: |")
    print(f"| {args.prefix} tokens, cold | {recompute * 1e3:.1f} | 0 | 1.00x |")
    print(f"| another prompt of {args.prefix}, asked again: cached on the device (the floor) | "
          f"{on_device * 1e3:.1f} | {(args.prefix - 1) // BLOCK * BLOCK} (0) | "
          f"{on_device / recompute:.3f}x |")  # fmt: skip
    print(f"| the same, from the host tier ({fillers} fillers pushed it there) | "
          f"{loaded * 1e3:.1f} | {cached} ({tiers.get('CPU', 0)}) | "
          f"{loaded / recompute:.3f}x |")  # fmt: skip

    # 4. beside decodes
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    ids = [f"d{i}" for i in range(args.decoders)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(3, vocab - 8) for _ in range(DECODE_PROMPT)], params)
    while (
        any(r.num_computed_tokens < DECODE_PROMPT for r in engine.scheduler.running)
        or len(engine.scheduler.running) < args.decoders
    ):
        engine.step()
    push_to_host(engine, prompt, rng, vocab)
    for _ in range(3):
        engine.step()

    def timed_step() -> tuple[float, list]:  # type: ignore[type-arg]
        sync()
        t0 = time.perf_counter()
        outs = engine.step()
        sync()
        return time.perf_counter() - t0, outs

    base = [timed_step()[0] for _ in range(args.steps)]
    loads = engine.scheduler.kv_loads
    assert loads is not None
    inline0 = loads.num_inline
    engine.add_request("beside", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    rows, first = [], None
    while first is None and len(rows) < 200:
        in_flight = "beside" in engine.scheduler.loading
        dt, outs = timed_step()
        # the load ran in this step: in flight at its start, started in it, or landed in it
        ran = in_flight or "beside" in engine.scheduler.loading or loads.num_inline > inline0
        inline0 = loads.num_inline
        computed = any(o.request_id == "beside" for o in outs)  # its tail, then a token
        rows.append((dt, ran, computed))
        first = next((o for o in outs if o.request_id == "beside"), None)
    engine.abort_requests(ids)
    b = statistics.fmean(base)
    during = [dt for dt, loading, computed in rows if loading and not computed]
    print(f"\n{args.decoders} sequences decoding; baseline step {b * 1e3:.2f} ms "
          f"(mean of {len(base)}, p50 {statistics.median(base) * 1e3:.2f})")  # fmt: skip
    print(
        "\n| step after arrival | wall ms | vs baseline | load ran in it | prompt computed in it |"
    )
    print("| ---: | ---: | ---: | --- | --- |")
    for i, (dt, loading, computed) in enumerate(rows):
        print(f"| {i + 1} | {dt * 1e3:.2f} | {dt / b:.2f}x | {'yes' if loading else ''} | "
              f"{'yes' if computed else ''} |")  # fmt: skip
    if during:
        print(f"\ndecode steps during the load, prompt not computing: {len(during)}, mean "
              f"{statistics.fmean(during) / b:.3f}x the baseline")  # fmt: skip
    else:
        print("\nno decode-only step ran during the load: it landed inside a step (the load "
              "rule) or with the prompt's own prefill")  # fmt: skip
    if first is not None:
        print(f"the prompt's tokens by tier: {first.num_tier_cached_tokens}, cached "
              f"{first.num_cached_tokens}")  # fmt: skip
    engine.close()


if __name__ == "__main__":
    main()
