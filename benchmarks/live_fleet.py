"""Live fleet vs simulator: cost-model replicas behind the real front door, per policy.

    python benchmarks/live_fleet.py --trace traces/mooncake_conversation_trace.jsonl \\
        --replicas 32 --speed 4 --requests 600 --time-scale 4 --out benchmarks/live/conv32

For each policy: ``kvroute serve --model sim:h100-8b --replicas N --policy P`` starts (a
fresh fleet: empty caches, empty index), ``kvroute bench`` replays the requests through
HTTP, then the fleet stops. The same requests then run through ``kvroute simulate``'s
engine. Live figures are divided by ``--time-scale`` (every replica step lasts that many
times its modelled time, so that 2 CPU cores keep up; arrivals are slowed by the same
factor), so both sides are in modelled seconds.

Besides the side-by-side table (hit rate, TTFT p50/p90, e2e p50), per policy: the
replicas' late steps (steps whose Python work outlasted their scaled modelled time -- the
run's fidelity), the front door's CPU per request and its added latency (front-door TTFT
minus the replica's, from /metrics). Progress goes to stderr; the table to stdout; per-run
JSON (``kvroute bench --json``) and ``summary.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_proc import start_serve, stop_serve

POLICIES = ("kv", "round_robin", "least_loaded", "approx_text")


def say(msg: str) -> None:
    print(f"live_fleet: {msg}", file=sys.stderr, flush=True)


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def replica_stats(n: int) -> list[dict[str, Any]]:
    """Each replica's engine counters, through Ray from this second driver."""
    import ray

    ray.init(address="auto", namespace="kvroute", logging_level="warning")
    try:
        actors = [ray.get_actor(f"replica-r{i}") for i in range(n)]
        return ray.get([a.stats.remote() for a in actors], timeout=60)
    finally:
        ray.shutdown()


def start_fleet(args: argparse.Namespace, policy: str, log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        "kvroute", "serve", "--model", args.model, "--replicas", str(args.replicas),
        "--block-size", str(args.block_size), "--time-scale", str(args.time_scale),
        "--policy", policy, "--port", str(args.port),
    ]  # fmt: skip
    say(" ".join(cmd))
    return start_serve(cmd, log, 300)


def stop_fleet(proc: subprocess.Popen[bytes]) -> None:
    stop_serve(proc, 60)


def run_live(args: argparse.Namespace, policy: str, out: Path) -> dict[str, Any]:
    log = out / f"serve_{policy}.log"
    proc = start_fleet(args, policy, log)
    url = f"http://127.0.0.1:{args.port}"
    try:
        cpu_idle = cpu_seconds(proc.pid)
        time.sleep(5.0)  # the idle front door's own CPU (load polls, event heartbeats)
        idle_share = (cpu_seconds(proc.pid) - cpu_idle) / 5.0
        started = time.monotonic()
        cpu0 = cpu_seconds(proc.pid)
        source = ["--trace", args.trace] if args.trace else ["--workload", args.workload]
        cmd = [
            "kvroute", "bench", "--url", url + "/v1", *source,
            "--speed", str(args.speed / args.time_scale), "--max-requests", str(args.requests),
            "--seed", str(args.seed), "--label", policy, "--json", str(out / f"{policy}.json"),
            "--timeout", str(args.timeout), "--slo-ttft", str(args.slo_ttft * args.time_scale),
            "--slo-itl", str(args.slo_itl * args.time_scale),
        ]  # fmt: skip
        say(f"{policy}: " + " ".join(cmd))
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        cpu = cpu_seconds(proc.pid) - cpu0
        wall = time.monotonic() - started
        m = metrics(url)
        stats = replica_stats(args.replicas)
    finally:
        stop_fleet(proc)
    steps = sum(s["steps"] for s in stats)
    late = sum(s["late_steps"] for s in stats)
    recent = "kvroute:router_added_latency_recent_seconds"
    added = {q: m.get(f'{recent}{{quantile="{q}"}}') for q in ("0.5", "0.99")}
    return {
        "front_door_cpu_s": cpu,
        "front_door_cpu_share": cpu / wall,
        "front_door_idle_share": idle_share,
        "front_door_marginal_cpu_s": cpu - idle_share * wall,
        "steps": steps,
        "late_steps": late,
        "late_s": sum(s["late_s"] for s in stats),
        "added_latency_s": added,
        "errors": {k: v for k, v in m.items() if k.startswith("kvroute:errors_total")},
    }


def run_sim(args: argparse.Namespace) -> dict[str, Any]:
    from kvroute.replica.model.cost_model import PROFILES
    from kvroute.sim.report import simulate
    from kvroute.sim.simulator import SimConfig
    from kvroute.sim.traces import load_mooncake, specs_from_trace
    from kvroute.sim.workloads import make_workload

    if args.trace:
        specs = specs_from_trace(load_mooncake(args.trace, args.requests), args.speed)
    else:
        specs = make_workload(args.workload, args.requests, args.seed, args.speed)
    cfg = SimConfig(
        replicas=args.replicas,
        block_size=args.block_size,
        profiles=(PROFILES[args.model.removeprefix("sim:")],),
    )
    return simulate(specs, list(args.policies), cfg)


def replica_side_ttft(path: Path) -> dict[str, float]:
    """p50/p90 of the TTFT each replica measured itself (its ``kvroute-timing`` comment)."""
    import numpy as np

    recs = json.loads(path.read_text())["records"]
    xs = [r["replica_ttft_s"] for r in recs if r.get("replica_ttft_s") is not None]
    if not xs:
        return {"p50": float("nan"), "p90": float("nan")}
    return {"p50": float(np.percentile(xs, 50)), "p90": float(np.percentile(xs, 90))}


def table(args: argparse.Namespace, live: dict[str, Any], sim: dict[str, Any]) -> str:
    s = args.time_scale
    b = sim["bounds"]
    lines = [
        f"{args.requests} requests of {args.trace or args.workload}, {args.replicas} "
        f"cost-model replicas ({args.model}), speed {args.speed}, time scale {s:g}; "
        f"live figures in modelled seconds (wall / {s:g}); pooled bound "
        f"{b['pooled_hit_rate']:.3f}",
        "",
        "| policy | hit live / sim | TTFT p50 live / sim s | TTFT p90 live / sim s "
        "| replica-side TTFT p50 / p90 s | e2e p50 live / sim s | late steps "
        "| front door CPU ms/req (above idle) | added p50 / p99 ms (wall) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in args.policies:
        r, x, m = live[p]["bench"], live[p]["fleet"], sim["policies"][p]
        added = x["added_latency_s"]
        lines.append(
            f"| {p} | {r['hit_rate']:.3f} / {m['hit_rate']:.3f} "
            f"| {r['ttft_s']['p50'] / s:.2f} / {m['ttft_s']['p50']:.2f} "
            f"| {r['ttft_s']['p90'] / s:.2f} / {m['ttft_s']['p90']:.2f} "
            f"| {x['replica_ttft_s']['p50'] / s:.2f} / {x['replica_ttft_s']['p90'] / s:.2f} "
            f"| {r['e2e_s']['p50'] / s:.2f} / {m['e2e_s']['p50']:.2f} "
            f"| {x['late_steps'] / max(x['steps'], 1):.1%} "
            f"| {1000 * x['front_door_marginal_cpu_s'] / max(r['requests'], 1):.1f} "
            f"| {1000 * (added['0.5'] or 0):.1f} / {1000 * (added['0.99'] or 0):.1f} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace")
    src.add_argument("--workload", choices=("tenants", "chat", "rag", "agents"))
    ap.add_argument("--model", default="sim:h100-8b")
    ap.add_argument("--replicas", type=int, default=32)
    ap.add_argument("--speed", type=float, default=1.0, help="modelled arrival-rate multiplier")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--time-scale", type=float, default=4.0)
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="modelled s")
    ap.add_argument("--slo-itl", type=float, default=0.1, help="modelled s")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--from-saved",
        action="store_true",
        help="no live runs: re-read the bench JSON files and fleet figures already in --out",
    )
    args = ap.parse_args()
    args.policies = [p for p in args.policies.split(",") if p]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    live: dict[str, Any] = {}
    saved = json.loads((out / "summary.json").read_text())["live"] if args.from_saved else {}
    for p in args.policies:
        t0 = time.monotonic()
        fleet = saved[p]["fleet"] if args.from_saved else run_live(args, p, out)
        fleet["replica_ttft_s"] = replica_side_ttft(out / f"{p}.json")
        bench = json.loads((out / f"{p}.json").read_text())["summary"]
        live[p] = {"fleet": fleet, "bench": bench}
        say(f"{p}: done in {time.monotonic() - t0:.0f} s; hit {bench['hit_rate']:.3f}")
    say("simulating the same requests ...")
    sim = run_sim(args)
    text = table(args, live, sim)
    print(text)
    (out / "table.md").write_text(text + "\n")
    sim_json = {
        k: {f: v for f, v in m.items() if f not in ("ttft_samples", "replicas")}
        for k, m in sim["policies"].items()
    }
    summary = {"args": vars(args), "live": live, "sim": sim_json, "bounds": sim["bounds"]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
