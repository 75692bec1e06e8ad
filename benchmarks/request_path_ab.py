"""The front door's cost per request and per streamed token, this tree against a baseline
commit, in one run.

    python benchmarks/request_path_ab.py [--baseline REV] [--rounds 2] [--requests 2000]
        [--streams 16] [--stream-tokens 256]

What runs: ``kvroute serve --model sim:h100-8b --replicas 2`` (cost-model replicas), from this
tree and from ``--baseline`` (a temporary ``git worktree`` put first on ``PYTHONPATH``), one
after the other, ``--rounds`` times, interleaved so that both see the same neighbours. Each
serve gets a warm-up, then closed-loop load over keep-alive connections: streamed
``/v1/completions`` with ``--prompt-tokens`` unique token ids (no prefix hits) and 4 output
tokens, first ``--requests`` at 16 concurrent, then a quarter as many one at a time; then
three waves of ``--streams`` streams of ``--stream-tokens`` tokens each (0: none). The
baseline's tree gets this tree's compiled hashing accelerator (``events/_chain*.so``, not in
git) when it has none: without it, its front door would hash every prompt in pure Python.

Printed per serve: the front-door process's CPU per request at 16 concurrent (utime + stime
of the ``kvroute serve`` process from ``/proc``, all its threads, replicas excluded, no idle
share subtracted), and the front door's own added TTFT, p50 and p90, at 16 concurrent and
at 1: ``router_ttft_s - replica_ttft_s`` from the stream's ``: kvroute-timing`` comment (the
handler's start to the first delta's write, less the replica's own time to first token),
which leaves out the client's side; and over the streams, the front-door process's CPU
per streamed token and the replica processes' (their pids from ``/fleet``), neither with an
idle share subtracted, and their voluntary context switches per token (wake-ups, which on a
small VM explain CPU per token with less noise than the CPU figure). Narrower and steadier
figures than ``frontdoor_capacity.py``'s, for one change's A/B.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_step_loop import baseline_tree
from proc_cpu import cpu_of, wakeups_of

ROOT = Path(__file__).resolve().parent.parent
TIMING = re.compile(rb'replica_ttft_s":([0-9.e-]+),"router_ttft_s":([0-9.e-]+)')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def requests(n: int, prompt_tokens: int, seed: int, max_tokens: int = 4) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        body = json.dumps(
            {
                "model": "sim:h100-8b",
                "prompt": [rng.randrange(1000, 128000) for _ in range(prompt_tokens)],
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        head = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        out.append(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
    return out


async def load(port: int, reqs: list[bytes], concurrency: int) -> list[float]:
    """Closed loop; the front door's added TTFT (s) of each request."""
    added: list[float] = []
    queue = list(reversed(reqs))

    async def worker() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while queue:
            writer.write(queue.pop())
            buf = b""
            while b"[DONE]" not in buf or not buf.endswith(b"0\r\n\r\n"):
                data = await reader.read(65536)
                if not data:
                    raise RuntimeError("the server closed the connection")
                buf += data
            if (m := TIMING.search(buf)) is not None:
                added.append(float(m.group(2)) - float(m.group(1)))
        writer.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return added


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def measure(label: str, pythonpath: str | None, args: argparse.Namespace, seed: int) -> dict:
    port = free_port()
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = ["kvroute", "serve", "--model", "sim:h100-8b", "--replicas", "2", "--port", str(port)]
    cmd += ["--max-in-flight", "4096"]
    proc = subprocess.Popen(
        cmd, env=env, cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError(f"{label}: kvroute serve did not come up")
        n, p = args.requests, args.prompt_tokens
        asyncio.run(load(port, requests(300, p, seed + 1000), 16))  # warm-up
        before = cpu_of({proc.pid})
        added16 = asyncio.run(load(port, requests(n, p, seed), 16))
        after = cpu_of({proc.pid})
        added1 = asyncio.run(load(port, requests(n // 4, p, seed + 1), 1))
        row = {
            "tree": label,
            "ms_per_request": (after[proc.pid] - before[proc.pid]) / n * 1e3,
            "added16": (pct(added16, 0.5), pct(added16, 0.9)),
            "added1": (pct(added1, 0.5), pct(added1, 0.9)),
            "fd_us_per_token": math.nan,
            "replica_us_per_token": math.nan,
            "fd_wakes_per_token": math.nan,
            "replica_wakes_per_token": math.nan,
        }
        if args.streams and args.stream_tokens:
            fleet = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/fleet"))
            reps = {int(r["pid"]) for r in fleet["replicas"]}
            sreqs = requests(3 * args.streams, p, seed + 2, max_tokens=args.stream_tokens)
            fd0, rep0 = cpu_of({proc.pid}), cpu_of(reps)
            wake0 = wakeups_of({proc.pid}), wakeups_of(reps)
            asyncio.run(load(port, sreqs, args.streams))
            fd1, rep1 = cpu_of({proc.pid}), cpu_of(reps)
            wake1 = wakeups_of({proc.pid}), wakeups_of(reps)
            tokens = len(sreqs) * args.stream_tokens
            row["fd_us_per_token"] = (fd1[proc.pid] - fd0[proc.pid]) / tokens * 1e6
            rep_cpu = sum(rep1.get(pid, 0.0) - rep0.get(pid, 0.0) for pid in reps)
            row["replica_us_per_token"] = rep_cpu / tokens * 1e6
            row["fd_wakes_per_token"] = (wake1[0] - wake0[0]) / tokens
            row["replica_wakes_per_token"] = (wake1[1] - wake0[1]) / tokens
        print(
            f"| {label} | {row['ms_per_request']:.3f} | {row['added16'][0]:.2f} / "
            f"{row['added16'][1]:.2f} | {row['added1'][0]:.2f} / {row['added1'][1]:.2f} | "
            f"{row['fd_us_per_token']:.1f} | {row['replica_us_per_token']:.1f} | "
            f"{row['fd_wakes_per_token']:.3f} | {row['replica_wakes_per_token']:.3f} |",
            flush=True,
        )
        return row
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["ray", "stop", "--force"], capture_output=True, check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=None, help="a commit to compare with")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--streams", type=int, default=16, help="concurrent streams (0: none)")
    ap.add_argument("--stream-tokens", type=int, default=256)
    args = ap.parse_args()
    trees: list[tuple[str, str | None]] = [("this tree", None)]
    tmp = None
    if args.baseline:
        tmp = Path(tempfile.mkdtemp(prefix="kvroute-ab-"))
        baseline_tree(args.baseline, tmp, name="kvroute")  # importable as kvroute from tmp
        trees.append((f"baseline {args.baseline}", str(tmp)))
    n_streams = args.streams
    per_token = f"CPU us / token ({n_streams} streams)"
    print("| tree | front door CPU ms / request (16 concurrent) | added TTFT p50 / p90 ms, "
          "16 concurrent | added TTFT p50 / p90 ms, 1 at a time | "
          f"front door {per_token} | replicas {per_token} | front door wake-ups / token | "
          "replicas wake-ups / token |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    try:
        for r in range(args.rounds):
            for label, path in trees:
                rows.append(measure(label, path, args, seed=r))
    finally:
        if tmp is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(tmp / "kvroute")], check=False)  # fmt: skip
    for label, _ in trees:
        mine = [x for x in rows if x["tree"] == label]
        print(
            f"| {label}, median of {len(mine)} | "
            f"{statistics.median(x['ms_per_request'] for x in mine):.3f} | "
            f"{statistics.median(x['added16'][0] for x in mine):.2f} | "
            f"{statistics.median(x['added1'][0] for x in mine):.2f} | "
            f"{statistics.median(x['fd_us_per_token'] for x in mine):.1f} | "
            f"{statistics.median(x['replica_us_per_token'] for x in mine):.1f} | "
            f"{statistics.median(x['fd_wakes_per_token'] for x in mine):.3f} | "
            f"{statistics.median(x['replica_wakes_per_token'] for x in mine):.3f} |",
            file=sys.stdout,
        )


if __name__ == "__main__":
    main()
