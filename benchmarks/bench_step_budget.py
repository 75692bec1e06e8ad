"""A CPU replica's step budget (``--max-num-batched-tokens``): first tokens against the time
per output token, in one run.

    OMP_NUM_THREADS=1 python benchmarks/bench_step_budget.py [--model smollm2-135m]
        [--budgets 2048,512,256] [--clients 8] [--prompt 320] [--output 64] [--requests 40]

Why: a step computes at most the budget's tokens; on a GPU a large one keeps the GEMMs
full, but a CPU's GEMMs run at their peak from a few dozen rows (``bench_linear.py``), so
the budget mostly decides how a burst of prompts is cut up. A large one prefills a burst in
one long step: every first token waits for the whole burst, and every running stream
stalls meanwhile; a small one finishes prompts one after the other between decode steps.
Here a closed loop of ``--clients`` (each sends a random ``--prompt``-token prompt, waits
for ``--output`` tokens, sends the next) runs on one engine in this process (no HTTP, one
torch thread), once per budget: TTFT p50 / p90 and TPOT p50 in wall time, output tokens
per second of wall time and per CPU second of this process.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from kvroute.replica import LLM, SamplingParams


def run(model: str, budget: int, a: argparse.Namespace) -> dict[str, float]:
    llm = LLM(model, max_num_batched_tokens=budget, enable_prefix_caching=True)
    engine = llm.llm_engine
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=a.output, ignore_eos=True)
    rng = random.Random(0)
    sent, start, first = 0, {}, {}
    ttft: list[float] = []
    tpot: list[float] = []

    def send(now: float) -> None:
        nonlocal sent
        rid = f"r{sent}"
        sent += 1
        start[rid] = now
        engine.add_request(rid, [rng.randrange(100, vocab - 100) for _ in range(a.prompt)], params)

    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(a.clients):
        send(time.perf_counter())
    done = 0
    while done < a.requests:
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            first.setdefault(o.request_id, now)
            if o.finished:
                done += 1
                ttft.append(first[o.request_id] - start[o.request_id])
                tpot.append((now - first[o.request_id]) / max(a.output - 1, 1))
                if sent < a.requests:
                    send(now)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    ttft.sort()
    return {
        "ttft_p50": statistics.median(ttft),
        "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))],
        "tpot_p50": statistics.median(tpot),
        "tok_s": done * a.output / wall,
        "tok_cpu_s": done * a.output / cpu,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--budgets", default="2048,512,256")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=320)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--requests", type=int, default=40)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(
        f"{a.model}, {a.clients} clients in a closed loop, {a.prompt}-token prompts, "
        f"{a.output} out, {a.requests} requests, one thread"
    )
    print("| budget | TTFT p50 | TTFT p90 | TPOT p50 | tok/s | tok/CPU s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for budget in (int(b) for b in a.budgets.split(",")):
        r = run(a.model, budget, a)
        print(
            f"| {budget} | {r['ttft_p50']:.2f} s | {r['ttft_p90']:.2f} s | "
            f"{r['tpot_p50'] * 1e3:.0f} ms | {r['tok_s']:.1f} | {r['tok_cpu_s']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
