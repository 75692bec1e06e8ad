"""The CPU ``kvroute router --backend`` spends per request in front of ``vllm serve`` -- with
no vLLM: fake backends that answer as ``vllm serve`` does.

    python benchmarks/router_http_cpu.py [--requests 400] [--concurrency 8] [--repeat 2]
        [--py-spy OUT.txt] [--pythonpath DIR]

What runs, all on this machine:

- the fakes (this file's ``--fake`` mode, one process for every backend): a raw asyncio
  HTTP/1.1 server per backend answering what the router asks of a ``vllm serve``:
  ``/v1/models``, ``/health``, ``/metrics`` (``vllm:cache_config_info`` with
  ``sha256_cbor`` hashing, the gauges, padded with histogram lines to the ~50 kB a real
  server renders), and ``POST /v1/completions`` streamed as vLLM streams it (chunked SSE:
  the first chunk with ``prompt_token_ids``, one chunk per token with its ``token_ids``,
  the finish chunk, the usage chunk with ``cached_tokens``, ``[DONE]``), after
  ``--ttft-ms`` then one chunk every ``--itl-ms``. Each also publishes vLLM-format KV
  events on a ZeroMQ PUB + replay ROUTER (:class:`kvroute.events.transport.ZmqEventPublisher`):
  a ``BlockStored`` of the prompt's new blocks per request, hashed as vLLM's
  ``sha256_cbor`` does, so the router indexes them and routes repeated prefixes back.
- ``kvroute router --backend URL=EVENTS,REPLAY ...`` over the fakes (``--pythonpath``: the
  tree it imports kvroute from, for an A/B against another commit).
- the load, from this process: a raw asyncio client (its own cost is no part of the
  figure) sending ``--requests`` streamed text completions at ``--concurrency``: prompts
  are ``--prefixes`` shared prefixes of ``--prefix-tokens`` tokens plus a unique
  ``--suffix-tokens`` suffix (random token ids of the model's vocabulary, decoded to text;
  the router tokenizes them again), ``--max-tokens`` out, ``ignore_eos``.

The figure: the router process tree's CPU (utime + stime from ``/proc``) during the run,
less its idle rate (measured for ``--idle-s`` before) times the run's wall time, per
request. The fakes' and the client's CPU are not in it. ``--py-spy FILE`` records the
router with py-spy (collapsed stacks) during the last run; ``--py-spy-idle FILE`` during
the idle window.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from proc_cpu import TICK, stat, tree

MODEL = "smollm2-135m"
BLOCK = 32


def say(msg: str) -> None:
    print(f"router_http_cpu: {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s(root: int) -> float:
    """utime + stime of ``root``'s live tree (seconds)."""
    total = 0.0
    for pid in tree(root):
        f = stat(pid)
        if f is not None:
            total += (int(f[11]) + int(f[12])) / TICK
    return total


def thread_cpu_s(root: int) -> dict[str, float]:
    """utime + stime per thread name (``comm``) of ``root``'s live tree (seconds)."""
    out: dict[str, float] = {}
    for pid in tree(root):
        for t in Path(f"/proc/{pid}/task").glob("*"):
            try:
                name = (t / "comm").read_text().strip()
                f = (t / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            out[name] = out.get(name, 0.0) + (int(f[11]) + int(f[12])) / TICK
    return out


def _per(before: dict[str, float], after: dict[str, float], div: float) -> dict[str, float]:
    """Each thread's CPU between two readings, divided by ``div``, in ms."""
    return {
        k: round((v - before.get(k, 0.0)) / div * 1000, 3)
        for k, v in sorted(after.items(), key=lambda kv: -(kv[1] - before.get(kv[0], 0.0)))
        if v - before.get(k, 0.0) > 0
    }


# -- the fake vllm serve --------------------------------------------------------------------
def _metrics_text(start: float, blocks: int, running: int) -> bytes:
    lines = [
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        'vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",'
        f'num_gpu_blocks="{blocks}",prefix_caching_hash_algo="sha256_cbor"}} 1.0',
        f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} {float(running)}',
        f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 0.0',
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.1',
        f"process_start_time_seconds {start}",
    ]
    # vLLM renders ~50 kB: histograms of latencies, token counts... (the router skips them)
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds", "request_prompt_tokens", "request_generation_tokens",
              "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_inference_time_seconds",
              "iteration_tokens_total"):  # fmt: skip
        lines.append(f"# HELP vllm:{h} Histogram of {h}.")
        lines.append(f"# TYPE vllm:{h} histogram")
        for le in [0.001 * 2**i for i in range(30)] + ["+Inf"]:
            lines.append(f'vllm:{h}_bucket{{engine="0",le="{le}",model_name="{MODEL}"}} 12.0')
        lines.append(f'vllm:{h}_count{{engine="0",model_name="{MODEL}"}} 12.0')
        lines.append(f'vllm:{h}_sum{{engine="0",model_name="{MODEL}"}} 3.5')
    return ("\n".join(lines) + "\n").encode()


class FakeVllm:
    """One ``vllm serve`` as the router sees it: HTTP and KV events."""

    def __init__(self, port: int, events: int, replay: int, root: str, a: argparse.Namespace):
        from kvroute.events.hashing import BlockHasher
        from kvroute.events.transport import ZmqEventPublisher

        self.port = port
        self.root = root
        self.ttft = a.ttft_ms / 1000
        self.itl = a.itl_ms / 1000
        self.start = time.time()
        self.running = 0
        self.hasher = BlockHasher("sha256_cbor_tagged", "vllm-none-hash", BLOCK)
        self.stored: set[bytes] = set()
        self.pub = ZmqEventPublisher(
            f"tcp://127.0.0.1:{events}",
            f"tcp://127.0.0.1:{replay}",
            topic="kv",
            heartbeat_interval=None,  # vLLM sends none
        )

    async def serve(self) -> None:
        server = await asyncio.start_server(self.conn, "127.0.0.1", self.port)
        async with server:
            await server.serve_forever()

    async def conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                length = 0
                for line in lines[1:]:
                    k, _, v = line.partition(":")
                    if k.lower() == "content-length":
                        length = int(v)
                body = await r.readexactly(length) if length else b""
                if method == "POST" and path == "/v1/completions":
                    await self.complete(json.loads(body), w)
                elif path == "/v1/models":
                    card = {"id": MODEL, "object": "model", "root": self.root,
                            "max_model_len": 2048, "owned_by": "vllm"}  # fmt: skip
                    self.reply(w, json.dumps({"object": "list", "data": [card]}).encode())
                elif path == "/metrics":
                    text = _metrics_text(self.start, 4096, self.running)
                    self.reply(w, text, b"text/plain; version=0.0.4")
                elif path == "/health":
                    self.reply(w, b"")
                else:
                    self.reply(w, b'{"detail":"Not Found"}', status=b"404 Not Found")
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()

    @staticmethod
    def reply(w: Any, body: bytes, ctype: bytes = b"application/json", status: bytes = b"200 OK"):
        head = b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
        w.write(head % (status, ctype, len(body)) + body)

    async def complete(self, body: dict[str, Any], w: Any) -> None:
        from kvroute.events.hashing import to_external
        from kvroute.events.wire import BlockStored

        prompt: list[int] = body["prompt"]
        n = int(body["max_tokens"])
        rid = f"cmpl-{body.get('request_id', 'x')}"
        hashes = self.hasher.hash_blocks(prompt, cache_salt=body.get("cache_salt"))
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.stored:
            hit += 1
        new = hashes[hit:]
        if new:
            parent = to_external(hashes[hit - 1], "int") if hit else None
            stored = BlockStored(
                block_hashes=[to_external(h, "int") for h in new],
                parent_block_hash=parent,
                token_ids=prompt[hit * BLOCK : len(hashes) * BLOCK],
                block_size=BLOCK,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
            self.stored.update(new)
            self.pub.publish([stored])
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": MODEL}
        self.running += 1
        try:
            await asyncio.sleep(self.ttft)
            for i in range(n):
                last = i == n - 1
                choice: dict[str, Any] = {
                    "index": 0, "text": f" w{i}", "logprobs": None,
                    "finish_reason": "length" if last else None, "stop_reason": None,
                }  # fmt: skip
                if i == 0:
                    choice["prompt_token_ids"] = prompt
                choice["token_ids"] = [1000 + i]
                self.event(w, {**head, "choices": [choice]})
                await w.drain()
                if not last:
                    await asyncio.sleep(self.itl)
            usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + n,
                     "completion_tokens": n,
                     "prompt_tokens_details": {"cached_tokens": hit * BLOCK}}  # fmt: skip
            self.event(w, {**head, "choices": [], "usage": usage})
            data = b"data: [DONE]\n\n"
            w.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
        finally:
            self.running -= 1

    @staticmethod
    def event(w: Any, obj: dict[str, Any]) -> None:
        data = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
        w.write(b"%x\r\n%s\r\n" % (len(data), data))


def run_fakes(a: argparse.Namespace) -> None:
    specs = [tuple(int(x) for x in s.split(",")) for s in a.fake]

    async def main() -> None:
        fakes = [FakeVllm(p, e, r, a.model_dir, a) for p, e, r in specs]
        await asyncio.gather(*(f.serve() for f in fakes))

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass


# -- the load -------------------------------------------------------------------------------
class Client:
    """One keep-alive HTTP/1.1 connection streaming completions (raw asyncio: cheap)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.r: asyncio.StreamReader | None = None
        self.w: asyncio.StreamWriter | None = None

    async def complete(self, payload: bytes) -> tuple[str, int, bool]:
        """(replica, SSE data lines, whether [DONE] came); deltas that arrive together
        leave the router as one chunk, so the lines may be fewer than the tokens."""
        if self.w is None:
            self.r, self.w = await asyncio.open_connection("127.0.0.1", self.port)
        assert self.r is not None
        self.w.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                     b"\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload))  # fmt: skip
        head = (await self.r.readuntil(b"\r\n\r\n")).decode("latin-1")
        status = head.split(" ", 2)[1]
        headers = {}
        for line in head.split("\r\n")[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        if "content-length" in headers:
            body = await self.r.readexactly(int(headers["content-length"]))
        else:
            parts = []
            while True:
                size = int((await self.r.readuntil(b"\r\n")).strip(), 16)
                parts.append(await self.r.readexactly(size + 2))
                if size == 0:
                    break
            body = b"".join(parts)
        if status != "200":
            raise RuntimeError(f"HTTP {status}: {body[:300]!r}")
        text = body.decode()
        return (
            headers.get("x-kvroute-replica", ""),
            text.count("data: {"),
            "data: [DONE]" in text,
        )


def make_prompts(a: argparse.Namespace, n: int, seed: int) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model_dir)
    rng = random.Random(seed)
    vocab = tok.vocab_size

    def text(k: int) -> str:
        return str(tok.decode([rng.randrange(100, vocab) for _ in range(k)]))

    prefixes = [text(a.prefix_tokens) for _ in range(a.prefixes)]
    return [prefixes[i % a.prefixes] + text(a.suffix_tokens) for i in range(n)]


async def drive(port: int, prompts: list[str], a: argparse.Namespace) -> dict[str, Any]:
    queue = list(reversed(prompts))
    per_replica: dict[str, int] = {}
    bad = 0

    async def worker() -> None:
        nonlocal bad
        c = Client(port)
        while queue:
            p = queue.pop()
            payload = json.dumps({
                "model": MODEL, "prompt": p, "max_tokens": a.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            }).encode()  # fmt: skip
            replica, chunks, done = await c.complete(payload)
            per_replica[replica] = per_replica.get(replica, 0) + 1
            if not done or not chunks:
                bad += 1

    await asyncio.gather(*(worker() for _ in range(a.concurrency)))
    return {"per_replica": per_replica, "bad": bad}


# -- main -----------------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=400, help="measured requests per run")
    p.add_argument("--warmup", type=int, default=48)
    p.add_argument("--repeat", type=int, default=2, help="measured runs (same router)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--backends", type=int, default=2)
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=512)
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--itl-ms", type=float, default=10.0)
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--policy", default="kv")
    p.add_argument("--pythonpath", default=None, help="PYTHONPATH for the router (A/B)")
    p.add_argument("--py-spy", default=None, metavar="FILE", help="py-spy raw, last run")
    p.add_argument("--py-spy-idle", default=None, metavar="FILE", help="py-spy raw, idle")
    p.add_argument("--model-dir", default=None, help="the tokenizer (default: smollm2-135m)")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--fake", action="append", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.model_dir is None:
        from kvroute.replica.model.models import smollm2_path

        a.model_dir = str(smollm2_path())
    if a.fake:
        run_fakes(a)
        return 0
    procs: list[subprocess.Popen[Any]] = []
    try:
        return measure(a, procs)
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _wait_http(port: int, path: str, timeout: float, proc: subprocess.Popen[Any]) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing answers on port {port}")


def _spy(pid: int, out: str) -> subprocess.Popen[Any]:
    return subprocess.Popen(
        ["py-spy", "record", "--pid", str(pid), "--format", "raw", "--rate", "250",
         "--threads", "--output", out],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _stop_spy(spy: subprocess.Popen[Any]) -> None:
    spy.send_signal(signal.SIGINT)
    spy.wait(timeout=60)


def measure(a: argparse.Namespace, procs: list[subprocess.Popen[Any]]) -> int:
    env = dict(os.environ)
    here_env = dict(os.environ)
    specs = [(free_port(), free_port(), free_port()) for _ in range(a.backends)]
    fake_cmd = [sys.executable, __file__, "--model-dir", a.model_dir,
                "--ttft-ms", str(a.ttft_ms), "--itl-ms", str(a.itl_ms)]  # fmt: skip
    for s in specs:
        fake_cmd += ["--fake", ",".join(map(str, s))]
    procs.append(subprocess.Popen(fake_cmd, env=here_env))
    for port, _, _ in specs:
        _wait_http(port, "/health", 60, procs[0])
    if a.pythonpath:
        env["PYTHONPATH"] = a.pythonpath
    rport = free_port()
    cmd = [sys.executable, "-m", "kvroute.deploy.cli", "router", "--host", "127.0.0.1",
           "--port", str(rport), "--events-topic", "kv", "--policy", a.policy]  # fmt: skip
    for port, events, replay in specs:
        cmd += ["--backend", f"http://127.0.0.1:{port}=tcp://127.0.0.1:{events},"
                f"tcp://127.0.0.1:{replay}"]  # fmt: skip
    router = subprocess.Popen(cmd, env=env)
    procs.append(router)
    _wait_http(rport, "/health", 120, router)
    out = subprocess.run(
        [sys.executable, "-c", "import kvroute.router as r; print(r.__file__)"],
        env=env, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    say(f"router pid {router.pid} on port {rport}, kvroute from {out}")
    prompts = make_prompts(a, a.warmup + a.requests * a.repeat, seed=1)
    say(f"warm-up: {a.warmup} requests")
    asyncio.run(drive(rport, prompts[: a.warmup], a))
    time.sleep(1.0)
    spy = _spy(router.pid, a.py_spy_idle) if a.py_spy_idle else None
    c0, th0, t0 = cpu_s(router.pid), thread_cpu_s(router.pid), time.monotonic()
    time.sleep(a.idle_s)
    idle_wall = time.monotonic() - t0
    idle = (cpu_s(router.pid) - c0) / idle_wall
    idle_threads = _per(th0, thread_cpu_s(router.pid), idle_wall)
    if spy is not None:
        _stop_spy(spy)
    say(f"idle: {idle * 1000:.1f} ms CPU per s; by thread (ms/s): {idle_threads}")
    runs = []
    for i in range(a.repeat):
        batch = prompts[a.warmup + i * a.requests : a.warmup + (i + 1) * a.requests]
        spy = _spy(router.pid, a.py_spy) if a.py_spy and i == a.repeat - 1 else None
        c0, th0, t0 = cpu_s(router.pid), thread_cpu_s(router.pid), time.monotonic()
        got = asyncio.run(drive(rport, batch, a))
        wall = time.monotonic() - t0
        used = cpu_s(router.pid) - c0
        threads = _per(th0, thread_cpu_s(router.pid), a.requests)
        if spy is not None:
            _stop_spy(spy)
        net = (used - idle * wall) / a.requests * 1000
        row = {
            "requests": a.requests,
            "wall_s": round(wall, 2),
            "req_per_s": round(a.requests / wall, 1),
            "cpu_ms_per_request": round(used / a.requests * 1000, 3),
            "net_cpu_ms_per_request": round(net, 3),
            "router_utilisation": round(used / wall, 3),
            "gross_ms_per_request_by_thread": threads,
            **got,
        }
        runs.append(row)
        say(f"run {i + 1}: {json.dumps(row)}")
    nets = [r["net_cpu_ms_per_request"] for r in runs]
    summary = {
        "idle_cpu_ms_per_s": round(idle * 1000, 2),
        "idle_ms_per_s_by_thread": idle_threads,
        "net_cpu_ms_per_request_median": round(statistics.median(nets), 3),
        "runs": runs,
        "args": {k: v for k, v in vars(a).items() if k != "fake"},
    }
    print(json.dumps(summary))
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))
    bad = sum(r["bad"] for r in runs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
