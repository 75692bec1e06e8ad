"""What a structured-output constraint costs the engine per token, beside the same requests
unconstrained, in one run.

Each round runs the same batch twice on one engine: ``n`` requests of ``tokens`` output
tokens each, free, then held to a regex of lowercase letters longer than they can spell
(the grammar's matcher fills a bitmask per row per step and takes every sampled token);
both make exactly ``tokens`` tokens a request. Prints the engine process's CPU and wall
time per output token, medians over interleaved rounds.

    python benchmarks/bench_structured.py            # tiny on this machine's device
    python benchmarks/bench_structured.py --streams 64 --tokens 128 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvroute.events.replica_api import SamplingParams, StructuredOutputs
from kvroute.replica.engine.llm_engine import EngineConfig, LLMEngine


def run_once(
    engine: LLMEngine, n: int, tokens: int, constrained: bool, tag: str
) -> tuple[float, float]:
    # More letters than the tokens can spell (a token is at most 16 of them here): the
    # grammar never completes, so both runs make exactly ``tokens`` tokens a request.
    so = StructuredOutputs(regex=f"[a-z]{{{16 * tokens}}}") if constrained else None
    params = SamplingParams(
        max_tokens=tokens, temperature=0.0, ignore_eos=True, structured_outputs=so
    )
    for i in range(n):
        engine.add_request(f"{tag}-{i}", f"Request {i}: spell a word.", params)
    cpu, wall = time.process_time(), time.perf_counter()
    made = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            made += len(out.outputs[0].token_ids) if out.finished else 0
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return cpu * 1e6 / made, wall * 1e6 / made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, num_blocks=4096))
    run_once(engine, 4, 16, True, "warm")  # xgrammar's tokenizer info, compile cache
    run_once(engine, 4, 16, False, "warm-free")
    print(f"model {args.model} on {engine.runner.device}; {args.tokens} tokens a request")
    print(f"{'streams':>8} {'free us/token cpu / wall':>26} {'regex us/token cpu / wall':>27}")
    for n in args.streams:
        free, held = [], []
        for r in range(args.rounds):
            free.append(run_once(engine, n, args.tokens, False, f"f{n}-{r}"))
            held.append(run_once(engine, n, args.tokens, True, f"h{n}-{r}"))
        fc, fw = (statistics.median(x[i] for x in free) for i in (0, 1))
        hc, hw = (statistics.median(x[i] for x in held) for i in (0, 1))
        print(f"{n:>8} {fc:>12.1f} / {fw:>9.1f}   {hc:>12.1f} / {hw:>9.1f}", flush=True)


if __name__ == "__main__":
    main()
