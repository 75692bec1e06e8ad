"""What LoRA adapters add to a decode step: the same batch with and without them, one run.

    python benchmarks/bench_lora_step.py [--model tiny,smollm2-135m] [--batch 32]
        [--adapters 4] [--rank 16] [--targets all|qv] [--prompt 256] [--steps 30]
        [--kernel grouped,dense] [--threads 1]

Issue 37's cost goal: on a CPU, a decode step at batch 32 that mixes 4 adapters costs at
most 1.3x the same step without adapters. Per model and kernel, one engine (kvroute's
decoder, fp32, eager) with ``--adapters`` random adapters registered (written here as PEFT
folders: rank ``--rank`` on every projection, or q and v only; random non-zero A and B) runs
in turn, ``--rounds`` times: ``base`` -- ``--batch`` sequences of ``--prompt`` random
tokens without adapters, prefilled, then ``--steps`` decode steps timed -- and ``lora`` --
the same prompts, the sequences spread evenly over the adapters. Printed per phase: the
process's CPU time per step (``time.process_time``: every thread of this process), wall
time per step, and the ratio to the base phase of the same round.

``--kernel`` names the grouped products' torch path (``kvroute.kernels.lora``): ``grouped``
(the CPU default: one batched GEMM over the slots in use when their rows are about as many
each, as in this decode batch, else torch's grouped_mm over the rows sorted by slot) or
``dense`` (every row against every slot; the path of devices without the grouped one).
``off`` is an engine without LoRA (its base phase only): what enabling LoRA costs a batch
that uses no adapter.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvroute.replica import LLM, SamplingParams
from kvroute.replica.model.models import resolve_model

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGETS = {"all": ALL, "qv": ("q_proj", "v_proj")}


def write_adapter(out: Path, config: dict, rank: int, targets: tuple[str, ...], seed: int) -> Path:
    """A PEFT adapter folder with random A and B for ``targets`` of every layer."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    shapes = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv * head_dim),
        "v_proj": (hidden, kv * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for t in targets:
            part = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{t}"
            fan_in, fan_out = shapes[t]
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(targets),
        "bias": "none",
    }
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def measure(llm: LLM, names: list[str | None], batch: int, prompt: int, steps: int, tag: str):  # type: ignore[no-untyped-def]
    """CPU and wall seconds per decode step of ``batch`` sequences, request i under
    ``names[i % len(names)]``."""
    engine = llm.llm_engine
    vocab = engine.runner.vocab_size
    rng = random.Random(batch)  # the same prompts in every phase
    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        tokens = [rng.randrange(3, vocab - 8) for _ in range(prompt)]
        engine.add_request(rid, tokens, params, lora_name=names[i % len(names)])
    running = engine.scheduler.running
    while len(running) < batch or any(r.num_computed_tokens < prompt for r in running):
        engine.step()
    for _ in range(3):  # every sequence decoding, adapters in their slots
        engine.step()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        engine.step()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    engine.abort_requests(ids)
    engine.reset_prefix_cache()  # the next phase computes its prompts again
    return cpu / steps, wall / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny,smollm2-135m")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="all", choices=sorted(TARGETS))
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kernel", default="off,grouped,dense")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (replicas: 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"# torch {torch.__version__}, {args.threads} thread(s), batch {args.batch}, "
        f"{args.adapters} adapters of rank {args.rank} on {args.targets} projections, "
        f"{args.prompt}-token prompts, {args.steps} decode steps per phase"
    )
    print("| model | kernel | round | phase | CPU ms/step | wall ms/step | vs base |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: |")
    tmp = Path(tempfile.mkdtemp(prefix="kvroute-bench-lora-"))
    ratios: dict[tuple[str, str], list[float]] = {}
    for model in args.model.split(","):
        try:
            path = resolve_model(model)
        except Exception as exc:  # smollm2 needs its wheel: skip, say why
            print(f"| {model} | skipped: {exc} |")
            continue
        config = json.loads((path / "config.json").read_text())
        targets = TARGETS[args.targets]
        modules = {
            f"a{i}": str(write_adapter(tmp / f"{model}-a{i}", config, args.rank, targets, i))
            for i in range(args.adapters)
        }
        for kernel in args.kernel.split(","):
            lora = kernel != "off"
            if lora:
                os.environ["KVROUTE_LORA_KERNEL"] = kernel  # read when the engine starts
            llm = LLM(
                model,
                dtype="float32",
                enforce_eager=True,
                max_num_batched_tokens=8192,
                max_num_seqs=max(args.batch, 8),
                lora_modules=modules if lora else {},
                max_loras=args.adapters,
                max_lora_rank=max(args.rank, 16),
            )
            for rnd in range(args.rounds):
                base_cpu, base_wall = measure(
                    llm, [None], args.batch, args.prompt, args.steps, f"b{rnd}"
                )
                print(
                    f"| {model} | {kernel} | {rnd} | base | {base_cpu * 1e3:.2f} "
                    f"| {base_wall * 1e3:.2f} | |",
                    flush=True,
                )
                if not lora:
                    continue
                cpu, wall = measure(
                    llm, list(modules), args.batch, args.prompt, args.steps, f"l{rnd}"
                )
                print(
                    f"| {model} | {kernel} | {rnd} | {args.adapters} adapters | {cpu * 1e3:.2f} "
                    f"| {wall * 1e3:.2f} | {cpu / base_cpu:.2f}x |",
                    flush=True,
                )
                ratios.setdefault((model, kernel), []).append(cpu / base_cpu)
            del llm
            gc.collect()
    os.environ.pop("KVROUTE_LORA_KERNEL", None)
    for (model, kernel), r in ratios.items():  # each round's pair ran back to back
        print(
            f"# {model} {kernel}: CPU per step with adapters / without, median of "
            f"{len(r)} rounds: {statistics.median(r):.2f}x (goal <= 1.3x)"
        )


if __name__ == "__main__":
    main()
