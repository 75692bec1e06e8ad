"""The serving path's CPU cost: kvroute's front door beside a floor, in one run.

    python benchmarks/frontdoor_capacity.py [--quick] [--json rows.json] [--plot cpu.png]

(``--quick``: about 2 minutes; without it about 10, on a 2-core machine.)

What runs: ``kvroute serve --model sim:h100-8b --replicas 2 --max-in-flight 4096`` (cost-model
replicas: the real scheduler and ZeroMQ data plane, no weights), and beside it the *floor*:
this file's ``--floor-server`` mode, a bare ASGI app (no FastAPI) under uvicorn with
httptools and uvloop that parses ``POST /v1/completions`` (token-id prompts) with msgspec,
round-robins it over :class:`ReplicaConnection` to the very replicas ``kvroute serve``
started (read from its ``GET /fleet``) and relays each delta as an SSE chunk -- no routing,
no tokenization, no validation, no auth. It is what any relay over the same data plane pays.

Load comes from ``kvroute bench`` (streamed, token-id prompts from a generated Mooncake-style
trace with unique prompts, so no run hits another's prefix cache), against each server in
turn, scenario by scenario. Every cost is CPU time read from ``/proc`` (utime + stime), never
wall time:

- front door: for kvroute, the ``kvroute serve`` process tree (the front door and its Ray
  gcs_server, raylet, agents, idle workers) *without* the replicas and the load generator;
  for the floor, its one process. Replicas: the replica pids from ``/fleet``.
- each run's CPU less an idle baseline (the same processes measured idle first, per second,
  times the run's wall time), divided by the output tokens or requests ``kvroute bench``
  counted: CPU per streamed token (256-token streams at 4..64 concurrent), CPU per request
  (``--prompt-tokens`` 512 in, 4 out, 16 concurrent).
- added TTFT (client TTFT less the replica's own, from the ``: kvroute-timing`` SSE comment,
  which the floor emits too) p50/p99 at 50 req/s of short requests.
- capacity: the concurrency sweep's tokens/s and the front door's utilisation (CPU s per
  wall s of load, idle share included); tokens/s per front-door core = tokens / its CPU s,
  i.e. the rate one core sustains, extrapolated when the run did not fill a core.

Everything shares one machine: the load generator (its CPU is reported) and the replicas
compete with the front doors, so achieved tokens/s is a lower bound; CPU per token is not
a wall-time figure and holds up under that contention better.
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
import urllib.request
from pathlib import Path
from typing import Any

from frontdoor_floor import MODEL, floor_server
from frontdoor_rows import derive, finite, plot, say, table
from proc_cpu import cpu_of, stat, tree

MOONCAKE_BLOCK = 512


class Group:
    """A set of processes whose CPU is measured together; ``pids()`` is re-read per
    snapshot, so a process started mid-run is counted from zero."""

    def __init__(self, name: str, pids: Any) -> None:
        self.name, self.pids = name, pids
        self.idle_per_s = 0.0

    def snap(self) -> dict[int, float]:
        return cpu_of(self.pids())

    @staticmethod
    def delta(a: dict[int, float], b: dict[int, float]) -> float:
        return sum(v - a.get(pid, 0.0) for pid, v in b.items())


# -- the harness ----------------------------------------------------------------------------
def http_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url} not up after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


class Runner:
    """Runs ``kvroute bench`` against one server and measures the CPU around it."""

    def __init__(self, tmp: Path, model: str = MODEL, bench_args: tuple[str, ...] = ()) -> None:
        self.tmp, self.model, self.bench_args = tmp, model, bench_args
        self.n_runs = 0

    def trace(self, n: int, prompt: int, output: int) -> Path:
        """``n`` unique prompts (fresh block ids: no run hits another's prefix cache)."""
        blocks = -(-prompt // MOONCAKE_BLOCK)
        base = 10_000 + self.n_runs * 10_000_000
        path = self.tmp / f"trace_{self.n_runs}.jsonl"
        with path.open("w") as f:
            for i in range(n):
                ids = list(range(base + i * blocks, base + (i + 1) * blocks))
                rec = {"timestamp": i, "input_length": prompt, "output_length": output}
                f.write(json.dumps({**rec, "hash_ids": ids}) + "\n")
        return path

    def run(
        self,
        server: str,
        url: str,
        fd: Group,
        reps: Group,
        scenario: str,
        *,
        n: int,
        prompt: int,
        output: int,
        concurrency: int | None = None,
        rate: float | None = None,
    ) -> dict[str, Any]:
        """One ``kvroute bench`` run: what it counted and the CPU each group spent."""
        self.n_runs += 1
        trace = self.trace(n, prompt, output)
        result = self.tmp / f"run_{self.n_runs}.json"
        mode = ["--concurrency", str(concurrency)] if concurrency else ["--rate", str(rate)]
        cmd = ["kvroute", "bench", "--url", url + "/v1", "--model", self.model]
        cmd += ["--trace", str(trace)]
        cmd += ["--max-requests", str(n), "--prompt-format", "tokens", "--no-progress"]
        cmd += ["--json", str(result), "--seed", str(self.n_runs), "--timeout", "120", *mode]
        cmd += self.bench_args
        f0, r0, t0 = fd.snap(), reps.snap(), time.monotonic()
        err = result.with_suffix(".err")
        with err.open("wb") as err_f:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err_f)
            _, status, usage = os.wait4(proc.pid, 0)  # its rusage: the load generator's CPU
        window = time.monotonic() - t0
        fd_cpu, rep_cpu = Group.delta(f0, fd.snap()), Group.delta(r0, reps.snap())
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise RuntimeError(f"kvroute bench failed ({proc.returncode}):\n{err.read_text()}")
        doc = json.loads(result.read_text())
        s, records = doc["summary"], doc["records"]
        ok = [r for r in records if r["error"] is None]
        raw = {
            "server": server,
            "scenario": scenario,
            "concurrency": concurrency,
            "rate": rate,
            "prompt_tokens": prompt,
            "max_tokens": output,
            "requests": s["requests"],
            "ok": s["ok"],
            "errors": s["errors"],
            "output_tokens": s["output_tokens"],
            "load_wall_s": s["wall_s"],
            "window_wall_s": window,
            "frontdoor_cpu_s": fd_cpu,
            "frontdoor_idle_per_s": fd.idle_per_s,
            "replica_cpu_s": rep_cpu,
            "replica_idle_per_s": reps.idle_per_s,
            "loadgen_cpu_s": usage.ru_utime + usage.ru_stime,
            # per request, for percentiles over several runs: as ``kvroute bench`` computes
            # its "TTFT outside the replica"
            "outside_s": [
                r["ttft_s"] - r["replica_ttft_s"]
                for r in ok
                if r["ttft_s"] is not None and r["replica_ttft_s"] is not None
            ],
            "ttft_s": [r["ttft_s"] for r in ok if r["ttft_s"] is not None],
        }
        row = derive([raw])
        if not raw["output_tokens"] or raw["errors"]:
            say(f"WARNING {server} {scenario}: {raw['output_tokens']} tokens, {raw['errors']}")
        say(
            f"{server:7s} {scenario:11s} {raw['ok']}/{raw['requests']} ok, "
            f"{raw['output_tokens']} tokens in {raw['load_wall_s']:.1f} s "
            f"({row['tokens_per_s']:.0f} tok/s); front door {row['frontdoor_us_per_token']:.0f}"
            f" us/token, {row['frontdoor_ms_per_request']:.2f} ms/request, "
            f"{row['frontdoor_util_cores']:.2f} cores; replicas "
            f"{row['replica_us_per_token']:.0f} us/token; added TTFT p50 "
            f"{row['added_ttft_p50_ms']:.1f} ms; load generator {raw['loadgen_cpu_s']:.1f} CPU s"
        )
        return raw


def measure_idle(groups: list[Group], seconds: float) -> None:
    snaps = [g.snap() for g in groups]
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    for g, s in zip(groups, snaps, strict=True):
        g.idle_per_s = Group.delta(s, g.snap()) / wall
        say(f"idle: {g.name} {1e3 * g.idle_per_s:.1f} ms CPU per s")


def identities(pids: set[int]) -> set[tuple[int, str]]:
    """(pid, start time): a process, not a pid that may be reused."""
    return {(p, f[19]) for p in pids if (f := stat(p)) is not None}


def stop(
    proc: subprocess.Popen[bytes] | None,
    leftovers: frozenset[tuple[int, str]] | set[tuple[int, str]] = frozenset(),
) -> None:
    """SIGINT, then SIGKILL after 60 s; then any of ``leftovers`` (processes it started, by
    pid and start time) that outlived it."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pid, started in leftovers:
        f = stat(pid)
        if f is not None and f[19] == started:
            say(f"killing a leftover process {pid}")
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def bench_all(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(one row per server and scenario, every run)."""
    raws: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="frontdoor_capacity_") as tmp_name:
        tmp = Path(tmp_name)
        serve_log, floor_log = tmp / "serve.log", tmp / "floor.log"
        serve = floor = None
        started: set[tuple[int, str]] = set()
        try:
            cmd = ["kvroute", "serve", "--model", MODEL, "--replicas", "2"]
            cmd += ["--port", str(args.port), "--max-in-flight", "4096", "--time-scale", "1"]
            say(" ".join(cmd))
            serve = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=serve_log.open("wb"))
            t_end = time.monotonic() + 180
            while "ready:" not in serve_log.read_text():
                if serve.poll() is not None or time.monotonic() > t_end:
                    raise RuntimeError(f"kvroute serve did not start:\n{serve_log.read_text()}")
                time.sleep(0.3)
            kv_url = f"http://127.0.0.1:{args.port}"
            fleet = http_json(kv_url + "/fleet")["replicas"]
            rep_pids = {int(r["pid"]) for r in fleet}
            say(f"replicas: {[(r['replica_id'], r['pid'], r['data_endpoint']) for r in fleet]}")
            fcmd = [sys.executable, os.path.abspath(__file__), "--floor-server"]
            fcmd += ["--port", str(args.floor_port), "--fleet-url", kv_url]
            floor = subprocess.Popen(fcmd, stdout=subprocess.DEVNULL, stderr=floor_log.open("wb"))
            fl_url = f"http://127.0.0.1:{args.floor_port}"
            wait_http(fl_url + "/health", floor, floor_log)
            say(f"floor ready on {fl_url} (pid {floor.pid})")
            serve_pid, floor_pid = serve.pid, floor.pid

            def reps_pids() -> set[int]:
                return set().union(*(tree(p) for p in rep_pids))

            kv = Group("kvroute front door tree", lambda: tree(serve_pid, exclude=rep_pids))
            fl = Group("floor", lambda: tree(floor_pid))
            reps = Group("replicas", reps_pids)
            started = identities(tree(serve_pid) | tree(floor_pid))
            say(f"kvroute front door tree: {len(kv.pids())} processes (replicas excluded)")
            time.sleep(2)  # let start-up settle
            measure_idle([kv, fl, reps], args.idle_seconds)

            runner = Runner(tmp)
            servers = [("kvroute", kv_url, kv), ("floor", fl_url, fl)]

            def both(scenario: str, rounds: int, **kw: Any) -> None:
                """``rounds`` runs per server, alternating and in turn first, so that what
                else the machine does lands on both alike; one row per server."""
                mine: dict[str, list[dict[str, Any]]] = {"kvroute": [], "floor": []}
                for i in range(rounds):
                    for name, url, group in servers[:: 1 if i % 2 == 0 else -1]:
                        mine[name].append(runner.run(name, url, group, reps, scenario, **kw))
                for name in ("kvroute", "floor"):
                    raws.extend(mine[name])
                    rows.append(derive(mine[name]))

            short = {"prompt": args.prompt_tokens, "output": args.short_tokens}
            c16 = args.request_concurrency
            warm = max(2 * c16, args.fill_requests)
            for name, url, group in servers:  # warm-up: connections, lazy imports, caches
                runner.run(name, url, group, reps, "warmup", n=warm, concurrency=c16, **short)
            both("per_request", args.rounds, n=args.requests, concurrency=c16, **short)
            n_rate = max(int(args.rate * args.rate_seconds / args.ttft_rounds), 20)
            both("ttft", args.ttft_rounds, n=n_rate, rate=args.rate, **short)
            for c in [int(x) for x in args.concurrency.split(",")]:
                both(
                    f"stream_c{c}",
                    args.rounds,
                    n=max(args.waves * c, 8),
                    concurrency=c,
                    prompt=args.prompt_tokens,
                    output=args.stream_tokens,
                )
            started |= identities(tree(serve_pid) | tree(floor_pid))
        finally:
            stop(floor)
            stop(serve, started)
    return rows, raws


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="about 2 minutes: fewer, shorter runs")
    ap.add_argument("--port", type=int, default=8131, help="kvroute serve")
    ap.add_argument("--floor-port", type=int, default=None, help="default: --port + 1")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--short-tokens", type=int, default=4, help="output of short requests")
    ap.add_argument("--request-concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=None, help="per run (default 600; quick 200)")
    ap.add_argument("--rate", type=float, default=50.0, help="req/s for the added-TTFT runs")
    ap.add_argument("--rate-seconds", type=float, default=None, help="per server (30; quick 8)")
    ap.add_argument("--ttft-rounds", type=int, default=None, help="alternating runs (4; quick 2)")
    ap.add_argument("--concurrency", default=None, help="streams (4,16,32,64,128; quick 4,16,64)")
    ap.add_argument("--stream-tokens", type=int, default=256)
    ap.add_argument("--waves", type=int, default=None, help="requests per stream slot (3; 2)")
    ap.add_argument("--rounds", type=int, default=None, help="runs per server and figure (2; 1)")
    ap.add_argument(
        "--fill-requests",
        type=int,
        default=0,
        help="unmeasured requests per server first: enough of them fill the replicas' KV "
        "caches, so the runs pay evictions (and the index their removals) as a long-running "
        "server does",
    )
    ap.add_argument("--idle-seconds", type=float, default=None, help="default 10 (quick: 4)")
    ap.add_argument("--json", default=None, help="write all rows (and every run) here")
    ap.add_argument("--plot", default=None, help="PNG: CPU per token against concurrency")
    ap.add_argument("--floor-server", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fleet-url", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.floor_server:
        floor_server(args.port, args.fleet_url)
        return 0
    q = args.quick
    args.floor_port = args.floor_port or args.port + 1
    args.requests = args.requests or (200 if q else 600)
    args.rate_seconds = args.rate_seconds or (8.0 if q else 30.0)
    args.ttft_rounds = args.ttft_rounds or (2 if q else 4)
    args.concurrency = args.concurrency or ("4,16,64" if q else "4,16,32,64,128")
    args.waves = args.waves or (2 if q else 3)
    args.rounds = args.rounds or (1 if q else 2)
    args.idle_seconds = args.idle_seconds or (4.0 if q else 10.0)
    t0 = time.monotonic()
    rows, raws = bench_all(args)
    say(f"done in {time.monotonic() - t0:.0f} s")
    print(table(rows, args))
    if args.json:
        runs = [{k: v for k, v in r.items() if k not in ("outside_s", "ttft_s")} for r in raws]
        doc = {"config": vars(args), "rows": rows, "runs": runs}
        Path(args.json).write_text(json.dumps(finite(doc), indent=1))
        say(f"rows: {args.json}")
    if args.plot:
        plot(rows, args.plot)
    bad = [r for r in rows if not r["output_tokens"] or r["errors"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
