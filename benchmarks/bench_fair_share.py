"""Fair share inside one engine: another tenant's TTFT while one tenant floods, per setting.

    python benchmarks/bench_fair_share.py [--seconds 40] [--flood 6] [--flood-output 64]
                                          [--plot F.png]

One cost-model engine (``sim:h100-8b``: the real scheduler, KV cache manager and queue;
each step sleeps the modelled H100 time x ``--time-scale``) keeps ``--flood`` requests of
tenant ``a`` in flight (2,048-token prompts, ``--flood-output`` output tokens each) while
tenant ``b`` sends one 256-token request (4 output tokens) at a time, 100-150 ms apart. A
request that arrives during a step waits for it, as in a served replica. Each setting runs
idle (``b`` alone) and under the flood, side by side:

- ``one queue``: no tenants passed to the engine (first come, first served: the baseline);
- ``tenants``: tenants passed, no step bound (fair queue, least-served first);
- ``+ threshold 256``: ``long_prefill_token_threshold`` 256;
- ``+ partial prefills 1``: and ``max_num_partial_prefills`` 1 (as docs/serving.md
  sets up several tenants).

TTFT is in wall seconds (divide by ``--time-scale`` for modelled H100 seconds); the ratio is
what the issue's goal reads (another tenant within 2x of its idle TTFT p90).
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from pathlib import Path

from kvroute.events.replica_api import SamplingParams
from kvroute.replica.engine.llm_engine import EngineConfig, LLMEngine

sys.path.insert(0, str(Path(__file__).parent))
from ttft_floor import floor_ratio

SETTINGS = {
    "one queue": (False, 0, 0),
    "tenants": (True, 0, 0),
    "+ threshold 256": (True, 256, 0),
    "+ partial prefills 1": (True, 256, 1),
}


def run(
    engine: LLMEngine, tenants: bool, flood: int, flood_output: int, seconds: float, first: int
) -> list[float]:
    """Tenant b's TTFTs over ``seconds`` with ``flood`` of a's requests kept in flight."""
    rng = random.Random(first)
    live: set[str] = set()
    n, ttfts = 0, []
    probe: str | None = None
    arrival = next_probe = time.perf_counter() + (2.0 if flood else 0.1)
    end = time.perf_counter() + seconds
    i = first
    while time.perf_counter() < end:
        while len(live) < flood:
            n += 1
            prompt = [(n * 977 + j) % 120_000 + 1 for j in range(2048)]
            params = SamplingParams(max_tokens=flood_output, ignore_eos=True)
            engine.add_request(f"a{n}", prompt, params, tenant="a" if tenants else None)
            live.add(f"a{n}")
        now = time.perf_counter()
        if probe is None and now >= next_probe:
            i += 1
            probe, arrival = f"b{i}", next_probe  # it arrived then, during the last step
            prompt = [(7 * i + j) % 120_000 + 1 for j in range(256)]  # its own first block
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            engine.add_request(probe, prompt, params, tenant="b" if tenants else None)
        if not engine.has_unfinished_requests():
            time.sleep(0.001)
            continue
        for out in engine.step():
            if out.request_id == probe and out.delta_token_ids and arrival:
                ttfts.append(time.perf_counter() - arrival)
                arrival = 0.0
            if out.finished:
                live.discard(out.request_id)
                if out.request_id == probe:
                    probe = None
                    next_probe = time.perf_counter() + 0.1 + 0.05 * rng.random()
    engine.abort_requests(sorted(live))
    while engine.has_unfinished_requests():
        engine.step()
    return ttfts


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def plot(path: str, rows: list[tuple[str, float, float]], title: str) -> None:
    """b's TTFT p90, idle and under the flood, per setting (log scale; needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r[0] for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    ax.bar([i - 0.2 for i in x], [r[1] for r in rows], 0.4, label="idle")
    ax.bar([i + 0.2 for i in x], [r[2] for r in rows], 0.4, label="tenant a flooding")
    for i, r in enumerate(rows):
        ax.annotate(f"{r[2] / r[1]:.2f}x", (i + 0.2, r[2]), ha="center", va="bottom")
    ax.axhline(2 * max(r[1] for r in rows), color="gray", ls="--", lw=1, label="2x idle")
    ax.set_yscale("log")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("tenant b TTFT p90 (ms, wall)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="per run (x2 per setting)")
    ap.add_argument("--flood", type=int, default=6, help="tenant a's requests in flight")
    ap.add_argument("--flood-output", type=int, default=64, help="output tokens per flood request")
    ap.add_argument("--time-scale", type=float, default=4.0)
    ap.add_argument("--plot", default=None, metavar="F.png", help="bar chart of the p90s")
    args = ap.parse_args()
    print(f"# {platform.node()} {platform.processor() or platform.machine()}; sim:h100-8b "
          f"x{args.time_scale:g}; flood {args.flood} x 2,048-token prompts, {args.flood_output} "
          f"output tokens; "
          f"{args.seconds:g} s per run", flush=True)  # fmt: skip
    print(f"{'setting':<22} {'idle p50':>9} {'idle p90':>9} {'flood p50':>10} {'flood p90':>10}"
          f" {'probes':>7} {'p90 ratio':>10} {'floor':>6}", flush=True)  # fmt: skip
    rows: list[tuple[str, float, float]] = []
    for k, (name, (tenants, threshold, partial)) in enumerate(SETTINGS.items()):
        config = EngineConfig(
            model="sim:h100-8b", block_size=16, num_blocks=4096, time_scale=args.time_scale,
            long_prefill_token_threshold=threshold, max_num_partial_prefills=partial,
        )  # fmt: skip
        engine = LLMEngine(config)
        idle = run(engine, tenants, 0, 0, args.seconds / 2, 10_000 * k)
        loaded = run(
            engine, tenants, args.flood, args.flood_output, args.seconds, 10_000 * k + 5_000
        )
        ms = [1000 * x for x in (sorted(idle)[len(idle) // 2], p90(idle))]
        ms += [1000 * x for x in (sorted(loaded)[len(loaded) // 2], p90(loaded))]
        print(f"{name:<22} {ms[0]:>7.0f}ms {ms[1]:>7.0f}ms {ms[2]:>8.0f}ms {ms[3]:>8.0f}ms "
              f"{len(loaded):>7} {p90(loaded) / p90(idle):>9.2f}x "
              f"{floor_ratio(p90(idle), 2048, args.time_scale):>5.2f}x", flush=True)  # fmt: skip
        rows.append((name, ms[1], ms[3]))
    if args.plot:
        title = (f"sim:h100-8b x{args.time_scale:g}: tenant a keeps {args.flood} x 2,048-token "
                 f"prompts in flight ({args.flood_output} output tokens each)")  # fmt: skip
        plot(args.plot, rows, title)


if __name__ == "__main__":
    main()
