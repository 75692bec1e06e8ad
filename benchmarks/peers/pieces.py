"""The pieces both phases of ``peers_vllm.py`` are built from.

Split out of ``benchmarks/peers_vllm.py``: :class:`Env` (the run's settings and folders),
:class:`Backend` (a ``vllm serve`` started with its KV events), starting one
(:func:`vllm_serve`), warming it, emptying its prefix cache, and one run of vLLM's own
``vllm bench serve`` client (:func:`bench`) with the figures kept from it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .procs import Server, answers, free_port, http, shell_line
from .setup import BLOCK_SIZE, MAX_MODEL_LEN, MODEL, VLLM_CLI, StartError, say

# --- the pieces -------------------------------------------------------------------------


@dataclass
class Env:
    args: argparse.Namespace
    out: Path
    model_dir: Path
    vllm_router: str | None

    @property
    def py(self) -> str:
        return self.args.vllm_python

    def vllm_cli(self) -> list[str]:
        return [self.py, *VLLM_CLI]

    def threads_env(self) -> dict[str, str]:
        t = str(self.args.threads)
        return {
            **os.environ,
            "VLLM_TARGET_DEVICE": os.environ.get("VLLM_TARGET_DEVICE", "cpu"),
            "OMP_NUM_THREADS": t,
            "MKL_NUM_THREADS": t,
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "PYTHONUNBUFFERED": "1",
        }


@dataclass
class Backend:
    server: Server
    events: str
    replay: str

    @property
    def url(self) -> str:
        return self.server.url

    def spec(self) -> str:
        return f"{self.url}={self.events},{self.replay}"


def vllm_serve(env: Env, name: str, kv_bytes: int, events: bool, eager: bool) -> Backend:
    port = free_port()
    cmd = [
        *env.vllm_cli(), "serve", str(env.model_dir), "--served-model-name", MODEL,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
        "--kv-cache-memory-bytes", str(kv_bytes), "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    if eager:
        cmd.append("--enforce-eager")
    ev = rp = ""
    if events:
        e, r = free_port(), free_port()
        # vLLM binds only a wildcard PUB endpoint (it connects to any other).
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{e}",
            "replay_endpoint": f"tcp://*:{r}",
            "topic": "kv",
        }
        cmd += ["--prefix-caching-hash-algo", "sha256_cbor",
                "--kv-events-config", json.dumps(kv_events)]  # fmt: skip
        ev, rp = f"tcp://127.0.0.1:{e}", f"tcp://127.0.0.1:{r}"
    cmd += env.args.vllm_serve_args
    penv = {**env.threads_env(), "VLLM_SERVER_DEV_MODE": "1"}  # POST /reset_prefix_cache
    url = f"http://127.0.0.1:{port}"
    return Backend(Server(name, cmd, penv, env.out / f"{name}.log", url), ev, rp)


def models_ready(url: str) -> Callable[[], bool]:
    return lambda: answers(url + "/v1/models")


def warm_up(url: str, n: int = 2) -> None:
    """A couple of requests no dataset shares (first-request costs: compile, allocation)."""
    for i in range(n):
        body = {"model": MODEL, "prompt": f"Warm-up {i}: " + "the quick brown fox " * 30,
                "max_tokens": 8, "temperature": 0}  # fmt: skip
        code, text = http("POST", url + "/v1/completions", body, timeout=600)
        if code != 200:
            raise StartError(f"warm-up request to {url} failed ({code}): {text[:500]}")


def reset_prefix_cache(b: Backend) -> None:
    for _ in range(60):
        code, text = http("POST", b.url + "/reset_prefix_cache", timeout=60)
        if code == 200 and json.loads(text).get("success"):
            return
        if code == 404:
            raise StartError(f"{b.url} has no /reset_prefix_cache (VLLM_SERVER_DEV_MODE?)")
        time.sleep(1.0)  # blocks still held: requests still finishing
    raise StartError(f"{b.url}: POST /reset_prefix_cache did not succeed: {code} {text[:300]}")


def bench(env: Env, url: str, label: str, dataset: list[str], num_prompts: int) -> dict:
    """One ``vllm bench serve`` run; its saved result, plus the command."""
    a = env.args
    result_dir = env.out / "client"
    result_dir.mkdir(exist_ok=True)
    fname = f"{label}.json"
    cmd = [
        *env.vllm_cli(), "bench", "serve", "--backend", "openai", "--base-url", url,
        "--endpoint", "/v1/completions", "--model", MODEL, "--tokenizer", str(env.model_dir),
        *dataset, "--num-prompts", str(num_prompts), "--max-concurrency", str(a.concurrency),
        "--seed", "0", "--ignore-eos", "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", fname,
        "--disable-tqdm",
    ]  # fmt: skip
    log = env.out / f"client-{label}.log"
    say(f"  {label}: vllm bench serve, {num_prompts} prompts, concurrency {a.concurrency}")
    t0 = time.monotonic()
    benv = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        try:
            rc = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=benv, timeout=a.client_timeout,
                stdin=subprocess.DEVNULL,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = -1
    path = result_dir / fname
    if rc != 0 or not path.exists():
        tail = log.read_text(errors="replace")[-4000:]
        raise StartError(f"vllm bench serve ({label}) failed (status {rc}); {log}:\n{tail}")
    r = json.loads(path.read_text())
    path.unlink()  # one result per file: a rerun must not append to an old one
    r["client_command"] = shell_line(cmd)
    r["client_wall_s"] = time.monotonic() - t0
    say(
        f"  {label}: {r.get('completed')} done, {r.get('failed', 0)} failed; TTFT p50 "
        f"{r['median_ttft_ms']:.0f} ms, p90 {r['p90_ttft_ms']:.0f} ms; TPOT p50 "
        f"{r['median_tpot_ms']:.1f} ms; {r['output_throughput']:.1f} output tok/s"
    )
    return r


def client_figures(r: dict) -> dict:
    keys = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "median_ttft_ms", "p90_ttft_ms",
            "p99_ttft_ms", "mean_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms",
            "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "client_command",
            "client_wall_s")  # fmt: skip
    return {k: r.get(k) for k in keys}
