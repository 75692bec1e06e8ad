"""How many requests/s front doors sustain before their own added latency grows.

    python benchmarks/frontdoor_capacity.py --routers 1,2 --rates 10,20,40,60,80

For each front-door count N: ``kvroute serve --model sim:h100-8b --replicas R --routers N``
(cost-model replicas: real engines, no weights), then ``kvroute bench`` at each Poisson
rate with short requests (``--prompt-tokens`` random ids, ``--max-tokens`` output), so
the replicas stay far from saturation and what grows with the rate is the front doors' work.

Per rate it prints the added latency -- TTFT seen by the client minus TTFT seen at the
replica (``kvroute bench``'s "TTFT outside the replica": HTTP, parsing, hashing, routing,
Ray both ways) -- p50/p99, the front doors' CPU per request (all front-door processes,
above their idle share), and errors. A front door's capacity is the highest rate whose
added p99 stays within ``--slo-ms``. Everything runs on this one machine: the load
generator and the replicas take CPU from the front doors, which the figures include.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def say(msg: str) -> None:
    print(f"frontdoor_capacity: {msg}", file=sys.stderr, flush=True)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def front_door_pids(serve_pid: int) -> list[int]:
    """The serve process and its ``kvroute router`` children."""
    pids = [serve_pid]
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == serve_pid and b"router" in cmd:
            pids.append(int(p.name))
    return pids


def total_cpu(pids: list[int]) -> float:
    return sum(cpu_seconds(p) for p in pids)


def run_rate(args: argparse.Namespace, rate: float, pids: list[int], out: Path) -> dict[str, Any]:
    n = max(int(rate * args.seconds), 20)
    trace = out / "trace.jsonl"
    if not trace.exists():  # unique prompts: one fresh block id per prompt block
        blocks = -(-args.prompt_tokens // 512)
        lines = [
            json.dumps({"timestamp": i, "input_length": args.prompt_tokens,
                        "output_length": args.max_tokens,
                        "hash_ids": list(range(10_000 + i * blocks, 10_000 + (i + 1) * blocks))})
            for i in range(20_000)
        ]  # fmt: skip
        trace.write_text("\n".join(lines) + "\n")
    result = out / f"rate_{rate:g}.json"
    cmd = [
        "kvroute", "bench", "--url", f"http://127.0.0.1:{args.port}/v1", "--trace", str(trace),
        "--rate", str(rate), "--max-requests", str(n), "--no-progress", "--json", str(result),
        "--label", f"{rate:g}/s", "--seed", "1",
    ]  # fmt: skip
    cpu0, t0 = total_cpu(pids), time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    cpu, wall = total_cpu(pids) - cpu0, time.monotonic() - t0
    s = json.loads(result.read_text())["summary"]
    outside = s.get("ttft_outside_replica_s") or {}
    return {
        "rate": rate,
        "requests": s["requests"],
        "achieved_rate": s["request_rate"],
        "added_p50_ms": 1000 * (outside.get("p50") or float("nan")),
        "added_p99_ms": 1000 * (outside.get("p99") or float("nan")),
        "cpu_s": cpu,
        "wall_s": wall,
        "errors": s["errors"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--routers", default="1,2")
    ap.add_argument("--rates", default="10,20,40,60,80")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=15.0, help="per rate")
    ap.add_argument("--slo-ms", type=float, default=5.0)
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--json", default=None, help="write all rows here")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for n in [int(x) for x in args.routers.split(",")]:
            log = out / f"serve_{n}.log"
            cmd = [
                "kvroute", "serve", "--model", "sim:h100-8b", "--replicas", str(args.replicas),
                "--routers", str(n), "--port", str(args.port), "--block-size", "16",
            ]  # fmt: skip
            say(" ".join(cmd))
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("wb"))
            try:
                while "ready: model" not in log.read_text():
                    if proc.poll() is not None:
                        raise RuntimeError(log.read_text())
                    time.sleep(0.5)
                pids = front_door_pids(proc.pid)
                idle0 = total_cpu(pids)
                time.sleep(5)
                idle = (total_cpu(pids) - idle0) / 5
                for rate in [float(x) for x in args.rates.split(",")]:
                    row = run_rate(args, rate, pids, out)
                    row["routers"] = n
                    row["cpu_ms_per_request"] = (
                        1000 * (row["cpu_s"] - idle * row["wall_s"]) / max(row["requests"], 1)
                    )
                    rows.append(row)
                    say(json.dumps(row))
            finally:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print("| front doors | offered req/s | achieved req/s | added p50 ms | added p99 ms "
          "| CPU ms/request | errors |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['routers']} | {r['rate']:g} | {r['achieved_rate']:.1f} | "
            f"{r['added_p50_ms']:.1f} | {r['added_p99_ms']:.1f} | "
            f"{r['cpu_ms_per_request']:.1f} | {sum(r['errors'].values()) if r['errors'] else 0} |"
        )
    for n in sorted({r["routers"] for r in rows}):
        ok = [r["rate"] for r in rows if r["routers"] == n and r["added_p99_ms"] <= args.slo_ms]
        print(f"{n} front door(s): highest rate with added p99 <= {args.slo_ms:g} ms: "
              f"{max(ok) if ok else 'none'}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
