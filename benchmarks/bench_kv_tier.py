"""A conversation's return served from a lower KV tier against its recompute (issue 38).

    python benchmarks/bench_kv_tier.py --out benchmarks/live/kv_tier

Three fleets in turn, each ``kvroute serve --model tiny --replicas 2`` with a device pool of
``--num-blocks`` per replica (about one conversation and a quarter each: two replicas hold
about two): without a lower tier (the recompute baseline), with a host tier, and with a disk
tier alone. In each, per round: four multi-turn conversations (``--turns`` turns of
``--turn-tokens`` new tokens each, a reply of 16 tokens), one after the other, then the
first one returns with a short new turn. Its prefix has left the device by then; the router
sends it to the replica whose lower tier holds it, which loads it instead of recomputing.
The return's TTFT (streamed, wall clock, median over rounds), its prompt tokens by the tier
that served them (the usage extension), and its text (greedy) go side by side: the text
must equal the no-tier fleet's, whose return is an uncached computation. /metrics' prefix
hits by tier close each fleet. Progress to stderr, the table to stdout, JSON to ``--out``.

    python benchmarks/bench_kv_tier.py --chat

Short prompts instead: ``kvroute bench --workload chat`` (``--chat-requests`` closed-loop
at concurrency 4) on fleets of ``--chat-blocks`` device blocks a replica: without a tier,
with a host tier whose loads always wait a step to land (``KVROUTE_KV_INLINE_LOADS=0``),
and with a host tier as it runs by default (replica/core/kv_loads.py), each repeated
``--chat-repeats`` times in turn (the machine's load drifts): TTFT, hit rate by tier,
errors, and the fleet's CPU seconds (from /proc) side by side.

    python benchmarks/bench_kv_tier.py --disk-cost

The disk tier's encryption at rest (issue 50) beside what it costs to write and load a
block, without and with it, per block of tiny and of an 8B model: the writer thread's
write, a load's read + authentication + copy into the cache (its page-cache copy warm, and
cold after dropping it), and AES-GCM's own seal and open, in CPU time of the thread doing
them; its share of each. Then a load of a run of 16 blocks (a returning conversation's
prefix) through the engine's own path (``KVTiers``: the disk fetcher's pipelined, bounded
reads, then the loader's copy into the cache), plain and sealed alternating, warm and cold,
without read-ahead and with it: wall and CPU us per block and the sealed share
(``--run-only`` for that part alone, ``--run-rounds`` passes of each).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_tier_costs import copy_cost, disk_cost, run_cost, say
from serve_proc import start_serve, stop_serve

ALPHABET = "abcdefghijklmnopqrstuvwxyz "


def start_fleet(
    args: argparse.Namespace, tier: list[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    cmd = [
        "kvroute", "serve", "--model", "tiny", "--replicas", "2",
        "--num-blocks", str(args.num_blocks), "--port", str(args.port), *tier,
    ]  # fmt: skip
    say(" ".join(cmd))
    return start_serve(cmd, log, 600, env)


def stop_fleet(proc: subprocess.Popen[bytes]) -> None:
    stop_serve(proc, 90)


def complete(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed greedy completion: TTFT (wall), text, usage."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    t0 = time.perf_counter()
    ttft, text, usage = None, [], {}
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                if choice.get("text"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(choice["text"])
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"ttft_s": ttft, "text": "".join(text), "usage": usage}


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvroute:prefix_cache_hits_by_tier_total"):
            k, v = line.rsplit(" ", 1)
            tier = k.split('tier="')[1].split('"')[0]
            out[tier] = out.get(tier, 0.0) + float(v)
    return out


def words(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def run_fleet(args: argparse.Namespace, name: str, tier: list[str], out: Path) -> dict[str, Any]:
    url = f"http://127.0.0.1:{args.port}"
    proc = start_fleet(args, tier, out / f"serve_{name}.log")
    returns = []
    try:
        for rnd in range(args.rounds):
            rng = random.Random(1000 + rnd)  # the same conversations in every fleet
            histories = []
            for c in range(4):
                history = ""
                for _ in range(args.turns):
                    history += f"\nuser {c}: " + words(rng, args.turn_tokens) + "\nbot:"
                    history += complete(url, history, 16)["text"]
                histories.append(history)
            back = histories[0] + "\nuser 0: " + words(rng, 24) + "\nbot:"
            got = complete(url, back, args.return_tokens)
            usage = got["usage"]
            details = usage.get("prompt_tokens_details") or {}
            returns.append(
                {
                    "round": rnd,
                    "prompt_tokens": usage.get("prompt_tokens"),
                    "cached_tokens": details.get("cached_tokens", 0),
                    "by_tier": details.get("cached_tokens_by_tier") or {},
                    "ttft_s": got["ttft_s"],
                    "text": got["text"],
                }
            )
            shown = {k: v for k, v in returns[-1].items() if k != "text"}
            say(f"{name} round {rnd}: {json.dumps(shown)}")
        hits = metrics(url)
    finally:
        stop_fleet(proc)
    return {"name": name, "returns": returns, "metrics_hits_by_tier": hits}


def chat_fleet(
    args: argparse.Namespace, name: str, tier: list[str], env: dict[str, str], out: Path
) -> dict[str, Any]:
    """One ``kvroute bench --workload chat`` run on a fresh fleet of small device pools."""
    from proc_cpu import tree_cpu_seconds

    url = f"http://127.0.0.1:{args.port}/v1"
    chat = argparse.Namespace(**{**vars(args), "num_blocks": args.chat_blocks})
    proc = start_fleet(chat, tier, out / f"serve_chat_{name}.log", env)
    result = out / f"chat_{name}.json"
    try:
        cpu0 = tree_cpu_seconds(proc.pid)
        cmd = [
            "kvroute", "bench", "--url", url, "--workload", "chat", "--concurrency", "4",
            "--max-requests", str(args.chat_requests), "--json", str(result), "--no-progress",
        ]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        cpu = tree_cpu_seconds(proc.pid) - cpu0
    finally:
        stop_fleet(proc)
    s = json.loads(result.read_text())["summary"]
    row = {
        "name": name,
        "ttft_p50_s": s["ttft_s"]["p50"],
        "ttft_p90_s": s["ttft_s"]["p90"],
        "e2e_p50_s": s["e2e_s"]["p50"],
        "hit_rate": s["hit_rate"],
        "by_tier": s["cached_tokens_by_tier"],
        "errors": sum(s["errors"].values()),
        "fleet_cpu_s": cpu,
        "wall_s": s["wall_s"],
    }
    say(f"chat {name}: {json.dumps(row)}")
    return row


def chat_main(args: argparse.Namespace, out: Path) -> int:
    host = ["--kv-host-bytes", str(args.chat_tier_bytes)]
    fleets: dict[str, tuple[list[str], dict[str, str]]] = {
        "none": ([], {}),
        # every load waits a step to land (the engine before kv_loads' rule)
        "host, loads off the step": (host, {"KVROUTE_KV_INLINE_LOADS": "0"}),
        "host": (host, {}),
    }
    load0 = os.getloadavg()
    rows = [
        chat_fleet(args, name, tier, env, out)
        for _ in range(args.chat_repeats)
        for name, (tier, env) in fleets.items()
    ]
    (out / "chat_results.json").write_text(json.dumps(rows, indent=1))
    print(f"\nload average at start {load0[0]:.1f}, at end {os.getloadavg()[0]:.1f} (2 cores)")
    print("| fleet | TTFT p50 / p90 ms | e2e p50 ms | hit rate | cached tokens by tier | "
          "errors | fleet CPU s | wall s |")  # fmt: skip
    print("| --- | --- | ---: | ---: | --- | ---: | ---: | ---: |")
    for r in rows:
        tiers = ", ".join(f"{k} {v}" for k, v in sorted(r["by_tier"].items()))
        print(
            f"| {r['name']} | {r['ttft_p50_s'] * 1000:.0f} / {r['ttft_p90_s'] * 1000:.0f} | "
            f"{r['e2e_p50_s'] * 1000:.0f} | {r['hit_rate']:.3f} | {tiers} | {r['errors']} | "
            f"{r['fleet_cpu_s']:.1f} | {r['wall_s']:.1f} |"
        )
    return 0


def chat_engine(args: argparse.Namespace) -> int:
    """The short-prompt case in one process, without the fleet's noise: one engine (`tiny`,
    ``--chat-blocks`` device blocks, a 64 MiB host tier), ``--chat-sessions`` conversations
    of ``--chat-turns`` turns (each turn 48-160 new tokens, 24 out, the prompt cut to its
    last ``--chat-context`` tokens), 4 at a time in a closed loop; the same conversations
    with the landing rule (replica/core/kv_loads.py) and with every load landing a step later,
    alternated ``--chat-repeats`` times. Per run: TTFT of all turns and of those that loaded
    from the host tier, in steps and in ms, and CPU seconds of the run."""
    import torch

    from kvroute.replica import EngineConfig, LLMEngine, SamplingParams
    from kvroute.replica.core import kv_loads

    torch.set_num_threads(1)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def one_run(inline: bool) -> dict[str, float]:
        kv_loads._INLINE = inline
        eng = LLMEngine(
            EngineConfig(model="tiny", block_size=16, num_blocks=args.chat_blocks,
                         kv_host_bytes=64 << 20)
        )  # fmt: skip
        rng = random.Random(7)
        histories = [[] for _ in range(args.chat_sessions)]
        turns = [0] * args.chat_sessions
        limit = min(args.chat_context, 16 * args.chat_blocks - 32)  # a turn's prompt
        todo = list(range(args.chat_sessions))
        live: dict[str, tuple[int, float, int]] = {}  # rid -> session, t0, step0
        ttft_steps, ttft_ms, loaded_steps, loaded_ms = [], [], [], []
        step, n = 0, 0
        cpu0 = time.process_time()

        def submit() -> None:
            nonlocal n
            s = todo.pop(0)
            h = histories[s]
            h += [rng.randrange(1, 250) for _ in range(rng.randrange(48, 160))]
            del h[: max(0, len(h) - limit)]
            rid = f"s{s}t{turns[s]}"
            n += 1
            eng.add_request(rid, list(h), params)
            live[rid] = (s, time.perf_counter(), step)

        while todo and len(live) < 4:
            submit()
        seen: set[str] = set()
        while live:
            outs = eng.step()
            step += 1
            for o in outs:
                s, t0, s0 = live[o.request_id]
                if o.request_id not in seen and o.outputs[0].token_ids:
                    seen.add(o.request_id)
                    dt, ds = (time.perf_counter() - t0) * 1000, step - s0
                    ttft_ms.append(dt)
                    ttft_steps.append(ds)
                    if o.num_tier_cached_tokens:
                        loaded_ms.append(dt)
                        loaded_steps.append(ds)
                if o.finished:
                    del live[o.request_id]
                    histories[s] += list(o.outputs[0].token_ids)
                    turns[s] += 1
                    if turns[s] < args.chat_turns:
                        todo.append(s)
                    if todo:
                        submit()
        eng.close()
        return {
            "cpu_s": time.process_time() - cpu0,
            "steps": step,
            "requests": n,
            "loaded": len(loaded_ms),
            "inline": eng.stats()["kv_tier_loads_inline"],
            "ttft_ms_p50": statistics.median(ttft_ms),
            "loaded_ttft_ms_p50": statistics.median(loaded_ms) if loaded_ms else float("nan"),
            "loaded_ttft_steps_mean": statistics.fmean(loaded_steps) if loaded_steps else 0.0,
            "ttft_steps_mean": statistics.fmean(ttft_steps),
        }

    load0 = os.getloadavg()
    rows = []
    for _ in range(args.chat_repeats):
        for inline in (False, True):
            row = {"rule": "on" if inline else "off (a step later)", **one_run(inline)}
            say(json.dumps(row))
            rows.append(row)
    print(f"\nload average at start {load0[0]:.1f}, at end {os.getloadavg()[0]:.1f} (2 cores)")
    print("| landing rule | turns (loaded, inline) | steps | CPU s | TTFT p50 ms, all / loaded | "
          "TTFT steps, all / loaded (mean) |")  # fmt: skip
    print("| --- | --- | ---: | ---: | --- | --- |")
    for r in rows:
        print(
            f"| {r['rule']} | {r['requests']} ({r['loaded']}, {r['inline']}) | {r['steps']} | "
            f"{r['cpu_s']:.2f} | {r['ttft_ms_p50']:.0f} / {r['loaded_ttft_ms_p50']:.0f} | "
            f"{r['ttft_steps_mean']:.2f} / {r['loaded_ttft_steps_mean']:.2f} |"
        )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/live/kv_tier")
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=1300, help="new tokens per turn")
    ap.add_argument("--return-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--num-blocks", type=int, default=320, help="device blocks per replica (of 16 tokens)"
    )
    ap.add_argument("--tier-bytes", type=int, default=256 << 20)
    ap.add_argument("--only", default="", help="comma-separated fleets: none,host,disk")
    ap.add_argument("--disk-path", default="/tmp/kvroute_bench_kv_disk")
    ap.add_argument("--copy-cost", action="store_true", help="only the per-block copy costs")
    ap.add_argument(
        "--disk-cost", action="store_true", help="only the disk tier's costs, with encryption"
    )
    ap.add_argument(
        "--run-only", action="store_true", help="--disk-cost: only the run-of-blocks loads"
    )
    ap.add_argument(
        "--run-rounds", type=int, default=15, help="--disk-cost: passes of each run load"
    )
    ap.add_argument(
        "--run-blocks", type=int, default=16, help="--disk-cost: blocks a run loads (1: alone)"
    )
    ap.add_argument("--chat", action="store_true", help="short prompts: kvroute bench chat")
    ap.add_argument(
        "--chat-engine", action="store_true", help="short prompts in one engine, in process"
    )
    ap.add_argument("--chat-sessions", type=int, default=12)
    ap.add_argument("--chat-context", type=int, default=512, help="--chat-engine's prompt cap")
    ap.add_argument("--chat-turns", type=int, default=6)
    ap.add_argument("--chat-blocks", type=int, default=48, help="--chat-engine: try 160")
    ap.add_argument("--chat-requests", type=int, default=60)
    ap.add_argument("--chat-repeats", type=int, default=2)
    ap.add_argument("--chat-tier-bytes", type=int, default=64 << 20)
    args = ap.parse_args()
    if args.chat_engine:
        return chat_engine(args)
    if args.chat:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        return chat_main(args, out)
    if args.copy_cost:
        copy_cost()
        return 0
    if args.disk_cost:
        root = Path(args.disk_path)
        root.mkdir(parents=True, exist_ok=True)
        load0 = os.getloadavg()
        if not args.run_only:
            disk_cost(root)
        run_cost(root, args.run_rounds, args.run_blocks)
        print(f"\nload average at start {load0[0]:.2f}, at end {os.getloadavg()[0]:.2f} "
              f"({os.cpu_count()} cores)")  # fmt: skip
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    disk = Path(args.disk_path)
    fleets = {
        "none": [],
        "host": ["--kv-host-bytes", str(args.tier_bytes)],
        "disk": ["--kv-disk-path", str(disk), "--kv-disk-bytes", str(args.tier_bytes)],
    }
    chosen = [f for f in (args.only.split(",") if args.only else fleets) if f]
    load0 = os.getloadavg()
    results = {name: run_fleet(args, name, fleets[name], out) for name in chosen}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    base = results.get("none")
    print(f"\nload average at start {load0[0]:.1f}, at end {os.getloadavg()[0]:.1f} (2 cores)")
    print("| fleet | return TTFT median ms (rounds) | prompt tokens | cached by tier | "
          "vs recompute | text = recompute's | /metrics hits by tier |")  # fmt: skip
    print("| --- | --- | ---: | --- | ---: | --- | --- |")
    med_base = statistics.median(r["ttft_s"] for r in base["returns"]) if base else None
    for name, res in results.items():
        rs = res["returns"]
        med = statistics.median(r["ttft_s"] for r in rs)
        each = ", ".join(f"{r['ttft_s'] * 1000:.0f}" for r in rs)
        tiers = "; ".join(
            f"dev {r['cached_tokens'] - sum(r['by_tier'].values())}"
            + "".join(f" {k} {v}" for k, v in r["by_tier"].items())
            for r in rs[:1]
        )
        ratio = f"{med / med_base:.2f}x" if med_base else "-"
        same = (
            all(r["text"] == b["text"] for r, b in zip(rs, base["returns"], strict=True))
            if base
            else "-"
        )
        hits = ", ".join(f"{k} {v:.0f}" for k, v in sorted(res["metrics_hits_by_tier"].items()))
        print(
            f"| {name} | {med * 1000:.0f} ({each}) | {rs[0]['prompt_tokens']} | {tiers} | "
            f"{ratio} | {same} | {hits} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
