"""Where a decode step's time goes: host work against GPU work, on a real model's shape.

    python benchmarks/bench_decode_step.py [--model tiny|llama-8b|gemma3-270m|PATH] [--batch 16,64]
        [--steps 60] [--impl before,kvroute] [--profile]

``--impl`` runs each batch size once per engine path, side by side in one run:
``before`` is the engine as it was before kvroute's own decoder (transformers' modules,
the torch reference's decode attention, unpacked CPU weights, no CUDA graphs),
``transformers`` the same modules with today's kernels, ``kvroute-eager`` kvroute's own
decoder (replica/model/decoder.py) without CUDA graphs, ``kvroute`` with them (on CUDA).

``llama-8b`` is a folder written on first use under ``$TMPDIR``: Llama-3.1-8B's layer shapes
(32 layers, hidden 4,096, 32 query / 8 KV heads of 128, MLP 14,336) with seeded random bf16
weights and ``tiny``'s byte-level tokenizer, so its vocabulary is 261 and not 128k: the
layers' work per token is 8B's, the LM head's is not. No download, ~14 GB of disk.

``gemma3-270m`` likewise: Gemma-3-270M's layers (18, hidden 640, 4 query heads / 1 KV head
of 256, MLP 2,048, a 512-token window on five layers of six), fp32 random weights written
by transformers under ``$TMPDIR``, ``tiny``'s tokenizer (vocabulary 261, not 262k).

Each batch size: ``N`` sequences of 512 random prompt tokens are prefilled, then ``--steps``
decode steps run back to back through ``LLMEngine.step``. Printed per step: wall time,
the process's CPU time, and the part spent in the scheduler and in the model runner. With
``--profile`` (CUDA only), five more steps under ``torch.profiler`` give the GPU's kernel
time per step and the number of kernel launches: a step whose wall time is far above its
GPU time is bound by the host (Python and launch overhead), not by the GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvroute.replica import LLM, SamplingParams
from kvroute.replica.model import tiny_model
from kvroute.replica.model.models import tiny_model_path

CUDA = torch.cuda.is_available()
PROMPT_TOKENS = 512
LLAMA_8B_LAYERS = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 500000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "torch_dtype": "bfloat16",
    "dtype": "bfloat16",
}


def write_llama_8b(folder: Path) -> Path:
    """tiny's folder with 8B's layer config and random weights (see the module docstring)."""
    if (folder / "model.safetensors").exists():
        return folder
    from safetensors.torch import save_file

    tmp = folder.with_name(folder.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(tiny_model_path(), tmp)
    config = dict(tiny_model.TINY_CONFIG, **LLAMA_8B_LAYERS)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    device = "cuda" if CUDA else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = tiny_model.tensor_shapes(config)
    weights = {}
    for i, (name, shape) in enumerate(shapes):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=torch.bfloat16)
            continue
        std = 1.0 if "embed" in name else 0.02
        x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std
        weights[name] = x.to(torch.bfloat16).cpu()
        if i % 32 == 0 or i == len(shapes) - 1:
            print(f"writing {folder.name}: tensor {i + 1}/{len(shapes)}", flush=True)
    save_file(weights, str(tmp / "model.safetensors"))
    tmp.rename(folder)
    return folder


def write_gemma3_270m(folder: Path) -> Path:
    """Gemma-3-270M's layer shapes, random fp32 weights (see the module docstring)."""
    if (folder / "config.json").exists():
        return folder
    import transformers
    from transformers import AutoModelForCausalLM

    layers = 18
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    config = transformers.Gemma3TextConfig(
        vocab_size=261, hidden_size=640, intermediate_size=2048, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
        layer_types=types, query_pre_attn_scalar=256, max_position_embeddings=32768,
        bos_token_id=256, eos_token_id=257, pad_token_id=258, tie_word_embeddings=True,
    )  # fmt: skip
    tmp = folder.with_name(folder.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
    for f in tiny_model_path().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp / f.name)
    tmp.rename(folder)
    return folder


IMPLS = {  # name: (model_impl, environment while it loads and runs, more engine settings)
    "before": (
        "transformers",
        {"KVROUTE_CPU_PREPACK": "0", "KVROUTE_CPU_DECODE_KERNEL": "0"},
        {"enforce_eager": True},
    ),
    "transformers": ("transformers", {}, {}),
    "kvroute-eager": ("kvroute", {}, {"enforce_eager": True}),
    "kvroute": ("kvroute", {}, {}),  # on CUDA: decode batches from CUDA graphs
}


def measure(model: str, batches: list[int], steps: int, profile: bool, impl: str) -> None:
    """One engine per path, loaded once; each batch size runs on it in turn."""
    model_impl, env, settings = IMPLS[impl]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        t0 = time.perf_counter()
        llm = LLM(model, max_num_batched_tokens=8192, model_impl=model_impl, **settings)
        graphs = llm.llm_engine.runner.decode_graphs
        print(
            f"| {impl} | engine ready in {time.perf_counter() - t0:.1f} s"
            f"{f', {len(graphs.buckets)} decode graphs' if graphs else ''} |",
            flush=True,
        )
        for batch in batches:
            _measure(llm.llm_engine, batch, steps, profile, impl)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    del llm, graphs  # the graphs hold the runner, and with it the KV cache
    gc.collect()  # engines hold reference cycles: free this one's KV cache for the next
    if CUDA:
        torch.cuda.empty_cache()


def _measure(engine, batch: int, steps: int, profile: bool, impl: str) -> None:  # type: ignore[no-untyped-def]
    vocab = engine.runner.model.config.vocab_size
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    ids = [f"{batch}-{i}" for i in range(batch)]
    for rid in ids:
        prompt = [rng.randrange(3, vocab - 8) for _ in range(PROMPT_TOKENS)]
        engine.add_request(rid, prompt, params)
    while len(engine.scheduler.running) < batch or any(
        r.num_computed_tokens < PROMPT_TOKENS for r in engine.scheduler.running
    ):
        engine.step()
    for _ in range(3):  # warm: every sequence decoding, allocator settled
        engine.step()
    spent = {"schedule": 0.0, "execute": 0.0}
    schedule, execute = engine.scheduler.schedule, engine.runner.execute

    def timed(name: str, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0

        return call

    engine.scheduler.schedule = timed("schedule", schedule)
    engine.runner.execute = timed("execute", execute)
    sync = torch.cuda.synchronize if CUDA else (lambda: None)
    sync()
    walls = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    sync()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    engine.scheduler.schedule, engine.runner.execute = schedule, execute
    ms = 1e3 / steps
    print(
        f"| {impl} | {batch} | {wall * ms:.2f} | {statistics.median(walls) * 1e3:.2f} "
        f"| {cpu * ms:.2f} "
        f"| {spent['schedule'] * ms:.2f} | {spent['execute'] * ms:.2f} "
        f"| {wall / steps / batch * 1e6:.0f} | {batch * steps / wall:,.0f} |",
        flush=True,
    )
    if profile and CUDA:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                engine.step()
            sync()
        events = prof.key_averages()
        cuda = torch.autograd.DeviceType.CUDA
        gpu_us = sum(e.self_device_time_total for e in events if e.device_type == cuda) / 5
        launch = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
        launches = sum(e.count for e in events if e.key in launch) / 5
        print(
            f"| {impl} | {batch} | GPU kernel time {gpu_us / 1e3:.2f} ms per step, "
            f"{launches:.0f} launches, wall/kernel {wall * 1e6 / steps / gpu_us:.2f}x |",
            flush=True,
        )
    engine.abort_requests(ids)  # frees their blocks for the next batch size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default="tiny", help="tiny, llama-8b, gemma3-270m, or a model folder"
    )
    ap.add_argument("--batch", default="16,64", help="comma-separated sequence counts")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--profile", action="store_true", help="kernel time and launches (CUDA)")
    ap.add_argument("--impl", default="before,kvroute", help=f"comma-separated: {', '.join(IMPLS)}")
    args = ap.parse_args()
    model = args.model
    if model == "llama-8b":
        model = str(write_llama_8b(Path(tempfile.gettempdir()) / "kvroute-llama-8b-rand"))
    elif model == "gemma3-270m":
        model = str(write_gemma3_270m(Path(tempfile.gettempdir()) / "kvroute-gemma3-270m"))
    name = torch.cuda.get_device_name() if CUDA else "cpu"
    print(f"# {name}, torch {torch.__version__}, model {args.model}, {args.steps} decode steps")
    head = "impl | batch | wall ms/step | median | CPU ms/step | schedule | runner"
    head += " | wall us/token | tok/s"
    print(f"| {head} |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    batches = [int(b) for b in args.batch.split(",")]
    for impl in args.impl.split(","):
        measure(model, batches, args.steps, args.profile, impl)


if __name__ == "__main__":
    main()
