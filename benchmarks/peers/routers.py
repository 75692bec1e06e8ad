"""Phase ``routers`` of ``peers_vllm.py``: front doors before two ``vllm serve``.

Split out of ``benchmarks/peers_vllm.py`` (whose docstring lists the front doors and the
workload): the dataset, starting each router over the shared backends, the runs, and each
router's own diagnostics.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable

from .pieces import (
    Backend,
    Env,
    bench,
    client_figures,
    models_ready,
    reset_prefix_cache,
    vllm_serve,
    warm_up,
)
from .procs import Server, Stack, answers, free_port, metric_sum, scrape, shell_line
from .setup import BLOCK_SIZE, MODEL, StartError, say

# --- phase B: routers -------------------------------------------------------------------


def router_dataset(a: argparse.Namespace) -> list[str]:
    return [
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(a.router_prefix_len),
        "--prefix-repetition-suffix-len", str(a.router_suffix_len),
        "--prefix-repetition-num-prefixes", str(a.router_prefixes),
        "--prefix-repetition-output-len", str(a.router_output_len),
    ]  # fmt: skip


def router_server(env: Env, name: str, backends: list[Backend]) -> tuple[Server, Callable]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = env.out / f"router-{name}.log"
    renv = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if name in ("kvroute", "kvroute-rr"):
        cmd = [env.py, "-m", "kvroute.deploy.cli", "router", "--host", "127.0.0.1",
               "--port", str(port), "--events-topic", "kv",
               "--policy", "kv" if name == "kvroute" else "round_robin"]  # fmt: skip
        for b in backends:
            cmd += ["--backend", b.spec()]

        def ready() -> bool:
            return "ready on" in log.read_text(errors="replace") and answers(url + "/v1/models")

        return Server(name, cmd, renv, log, url), ready
    if env.vllm_router is None:
        raise StartError(
            "vllm-router not found: pip install vllm-router==0.1.17 (in any venv) and give "
            "--vllm-router PATH, or leave the vllm-router runs out of --routers"
        )
    policy = name.removeprefix("vllm-router-")
    policy = {"rr": "round_robin"}.get(policy, policy)
    cmd = [env.vllm_router, "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *[b.url for b in backends], "--policy", policy,
           "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1",
           "--worker-startup-timeout-secs", "120"]  # fmt: skip
    if policy == "kv_aware":
        cmd += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", MODEL]
        for b in backends:
            cmd += ["--kv-event-source", f"{b.url}={b.events}",
                    "--kv-event-replay-source", f"{b.url}={b.replay}"]  # fmt: skip
        # HTTP workers: the router tokenizes only with a local tokenizer to read.
        renv["VLLM_ROUTER_TOKENIZER"] = str(env.model_dir)
    cmd += env.args.vllm_router_args

    def vr_ready() -> bool:
        # It proxies /v1/models to a worker once it has a healthy one.
        return answers(url + "/v1/models") and answers(url + "/health")

    return Server(name, cmd, renv, log, url), vr_ready


def start_backends(env: Env, stack: Stack) -> list[Backend]:
    a = env.args
    bs = [vllm_serve(env, f"backend-{i}", a.router_kv_mib << 20, events=True,
                     eager=a.backend_eager) for i in range(2)]  # fmt: skip
    for b in bs:
        stack.server(b.server)
    for b in bs:
        b.server.wait_ready(models_ready(b.url), a.start_timeout)
    for b in bs:
        warm_up(b.url)
        reset_prefix_cache(b)
    return bs


def routers_phase(env: Env) -> list[dict]:
    a = env.args
    rows: list[dict] = []
    stack = Stack()
    try:
        backends = start_backends(env, stack)
        backend_cmd = shell_line(backends[0].server.cmd)
        for i, name in enumerate(a.routers):
            if i > 0 and a.restart_backends:
                stack.close()
                backends = start_backends(env, stack)
            elif i > 0:
                for b in backends:
                    reset_prefix_cache(b)
            say(f"router {name}")
            with Stack() as rs:
                server, ready = router_server(env, name, backends)
                rs.server(server)
                server.wait_ready(ready, a.start_timeout)
                time.sleep(2.0)  # event subscriptions settle; health checks pass
                # Its CPU while idle (load polls, health checks, event subscriptions).
                idle0, t_idle = server.cpu_seconds(), time.monotonic()
                time.sleep(a.idle_seconds)
                idle_rate = (server.cpu_seconds() - idle0) / (time.monotonic() - t_idle)
                m0 = [scrape(b.url + "/metrics") for b in backends]
                spy = py_spy(env, name, server) if a.router_py_spy else None
                cpu0, t_run = server.cpu_seconds(), time.monotonic()
                r = bench(env, server.url, f"routers-{name}", router_dataset(a), a.router_prompts)
                cpu1, t_run = server.cpu_seconds(), time.monotonic() - t_run
                if spy is not None:
                    spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                    spy.wait(timeout=60)
                m1 = [scrape(b.url + "/metrics") for b in backends]
                extra = router_diagnostics(name, server)
            dq = dh = 0.0
            per_backend = []
            for x0, x1 in zip(m0, m1, strict=True):
                q = "vllm:prefix_cache_queries_total"
                h = "vllm:prefix_cache_hits_total"
                n = "vllm:request_success_total"
                dq += metric_sum(x1, q) - metric_sum(x0, q)
                dh += metric_sum(x1, h) - metric_sum(x0, h)
                per_backend.append(int(metric_sum(x1, n) - metric_sum(x0, n)))
            done = r.get("completed") or 0
            rows.append({
                "router": name, **client_figures(r),
                "hit_rate": dh / dq if dq > 0 else None,
                "prompt_tokens_looked_up": dq, "prompt_tokens_hit": dh,
                "requests_per_backend": per_backend,
                "router_cpu_s": cpu1 - cpu0,
                "router_cpu_ms_per_request": 1000 * (cpu1 - cpu0) / done if done else None,
                "router_idle_cpu_s_per_s": idle_rate, "router_run_wall_s": t_run,
                "router_cpu_ms_per_request_less_idle": (
                    1000 * (cpu1 - cpu0 - idle_rate * t_run) / done if done else None
                ),
                "router_command": shell_line(server.cmd), **extra,
                "backend_command": backend_cmd,
            })  # fmt: skip
    finally:
        stack.close()
    return rows


def py_spy(env: Env, name: str, server: Server) -> subprocess.Popen[bytes] | None:
    """py-spy recording a kvroute router (raw collapsed stacks, every thread) until
    SIGINT; None for the other front doors (not Python)."""
    if not name.startswith("kvroute") or server.proc is None:
        return None
    out = env.out / f"router-{name}.py-spy.txt"
    cmd = ["py-spy", "record", "--pid", str(server.proc.pid), "--format", "raw",
           "--threads", "--rate", "200", "--output", str(out)]  # fmt: skip
    say(f"profiling {name}: {shell_line(cmd)}")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def router_diagnostics(name: str, server: Server) -> dict:
    """vllm-router's own account of its cache-aware and KV-aware decisions, if it has one."""
    if not name.startswith("vllm-router"):
        return {}
    m = re.search(r"--prometheus-port (\d+)", " ".join(server.cmd))
    if not m:
        return {}
    try:
        samples = scrape(f"http://127.0.0.1:{m.group(1)}/metrics")
    except OSError:
        return {}
    keep = {
        f"vllm_router_{n}_total"
        for n in ("kv_routing_inputs", "kv_placement_lookups", "cache_hits", "cache_misses",
                  "policy_decisions", "processed_requests")
    }  # fmt: skip
    return {"router_metrics": [f"{n}{lab} {v:g}" for n, lab, v in samples if n in keep]}
