"""Priorities at the front door: an interactive band's TTFT while a batch band floods.

    python benchmarks/bench_priority.py [--model tiny] [--seconds 20] [--flood 16]

A real ``kvroute serve`` (its own process; one replica of ``--model``, default the built-in
``tiny``: a real forward pass on the CPU) and two tenants: ``batch`` keeps ``--flood``
requests of priority 5 in flight (``--batch-prompt``-token prompts, ``--batch-output``
tokens each), ``chat`` sends one request of priority 0 (the default) at a time, 100-150 ms
apart (``--chat-prompt`` tokens, 4 output tokens). Each is run twice, with flow control
(each of ``--flow-depth``'s, e.g. ``16,4``) and without it (``--flow-depth 0``):

- chat TTFT p50/p90 alone (idle), then under the batch flood, and their p90 ratio;
- batch tokens/s with chat idle (the flood alone), and under chat's probes;
- batch TTFT p99 under the flood (its wait: at the door and in the engine).

What flow control should show: chat's p90 under the flood close to idle (the batch band
waits at the door, chat's requests go ahead of it), at little cost to batch throughput
(the replica stays full: the queue is work-conserving).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve_proc import start_serve, stop_serve
from ttft_floor import floor_ratio

VOCAB = 250  # tiny's byte-level vocabulary; fine for any model with more
KEYS = {"key-chat": "chat", "key-batch": "batch"}


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[int(q * (len(xs) - 1))] if xs else float("nan")


async def ttft_and_tokens(
    http: httpx.AsyncClient, url: str, key: str, body: dict
) -> tuple[float, int]:
    """Seconds to the first content chunk, and the output tokens (usage)."""
    start = time.perf_counter()
    first, tokens = None, 0
    headers = {"Authorization": f"Bearer {key}"}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return (first if first is not None else float("nan")), tokens


class Phase:
    """One run: optional flood, optional chat probes, for ``seconds``."""

    def __init__(self, args: argparse.Namespace, url: str, salt: int) -> None:
        self.args, self.url, self.salt = args, url + "/v1/completions", salt
        self.chat: list[float] = []
        self.batch_ttft: list[float] = []
        self.batch_tokens = 0

    async def flooder(self, http: httpx.AsyncClient, c: int, end: float) -> None:
        a, n = self.args, 0
        while time.perf_counter() < end:
            n += 1
            # its own first block per request and phase: no phase hits another's cache
            head = [self.salt % VOCAB + 1, c % VOCAB + 1, n % VOCAB + 1, n // VOCAB + 1]
            prompt = head + [(c * 977 + n * 31 + j) % VOCAB + 1 for j in range(a.batch_prompt - 4)]
            body = {"prompt": prompt, "max_tokens": a.batch_output, "ignore_eos": True,
                    "priority": 5}  # fmt: skip
            ttft, tokens = await ttft_and_tokens(http, self.url, "key-batch", body)
            if time.perf_counter() < end:  # what ends after the window is not counted
                self.batch_ttft.append(ttft)
                self.batch_tokens += tokens

    async def prober(self, http: httpx.AsyncClient, end: float, seed: int) -> None:
        a, rng, i = self.args, random.Random(seed), seed
        while time.perf_counter() < end:
            i += 1
            head = [self.salt % VOCAB + 1, i % VOCAB + 1, i // VOCAB + 1]
            prompt = head + [(7 * i + j) % VOCAB + 1 for j in range(a.chat_prompt - 3)]
            body = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True}
            ttft, _ = await ttft_and_tokens(http, self.url, "key-chat", body)
            self.chat.append(ttft)
            await asyncio.sleep(0.1 + 0.05 * rng.random())

    async def run(self, flood: bool, probes: bool, seed: int) -> Phase:
        a = self.args
        limits = httpx.Limits(max_connections=a.flood + 8, max_keepalive_connections=a.flood + 8)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            warm = time.perf_counter() + (2.0 if flood else 0.0)  # the flood on first
            end = warm + a.seconds
            tasks = [self.flooder(http, c, end) for c in range(a.flood)] if flood else []
            if probes:

                async def late_probes() -> None:
                    await asyncio.sleep(max(0.0, warm - time.perf_counter()))
                    await self.prober(http, end, seed)

                tasks.append(late_probes())
            await asyncio.gather(*tasks)
        return self


def serve(args: argparse.Namespace, depth: int, tmp: Path) -> object:
    keys = tmp / "keys.json"
    keys.write_text(json.dumps(KEYS))
    cmd = [sys.executable, "-m", "kvroute.deploy.cli", "serve", "--model", args.model,
           "--replicas", "1", "--api-keys", str(keys), "--port", str(args.port),
           "--flow-depth", str(depth), "--max-in-flight", "256"]  # fmt: skip
    cmd += shlex.split(args.serve_args)
    if args.model.startswith("sim:"):  # cost-model replicas: the step times of a real GPU
        cmd += ["--time-scale", str(args.time_scale)]
    return start_serve(cmd, tmp / f"serve-{depth}.log", 600)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny, or sim:h100-8b (cost model)")
    ap.add_argument("--time-scale", type=float, default=4.0, help="sim: replicas' slow-down")
    ap.add_argument("--seconds", type=float, default=20.0, help="per phase")
    ap.add_argument("--flood", type=int, default=16, help="batch requests in flight")
    ap.add_argument("--batch-prompt", type=int, default=512)
    ap.add_argument("--batch-output", type=int, default=32)
    ap.add_argument("--chat-prompt", type=int, default=64)
    ap.add_argument(
        "--flow-depth", default="16", help="flow control's depths to run (comma-separated)"
    )
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument(
        "--serve-args",
        default="",
        help="more kvroute serve flags, e.g. '--long-prefill-token-threshold 256 "
        "--max-num-partial-prefills 1' (the engine's step bound)",
    )
    args = ap.parse_args()
    print(f"# {platform.node()} {platform.machine()}; {args.model}, 1 replica; batch: "
          f"{args.flood} x {args.batch_prompt}-token prompts, {args.batch_output} output tokens, "
          f"priority 5; chat: {args.chat_prompt}-token prompts, priority 0; {args.seconds:g} s "
          "per phase", flush=True)  # fmt: skip
    print(f"{'flow control':<14} {'chat idle p50/p90':>18} {'chat flood p50/p90':>19} "
          f"{'ratio':>6} {'floor':>6} {'batch tok/s alone':>18} {'with chat':>10} "
          f"{'batch TTFT p99':>15}",
          flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        runs = [(f"on (depth {d})", int(d)) for d in args.flow_depth.split(",")] + [("off", 0)]
        for k, (label, depth) in enumerate(runs):
            proc = serve(args, depth, Path(d))
            url = f"http://127.0.0.1:{args.port}"
            try:
                idle = asyncio.run(Phase(args, url, 3 * k).run(False, True, 0))
                alone = asyncio.run(Phase(args, url, 3 * k + 1).run(True, False, 0))
                both = asyncio.run(Phase(args, url, 3 * k + 2).run(True, True, 10_000))
            finally:
                stop_serve(proc, 60)
            ms = [1000 * pct(xs, q) for xs in (idle.chat, both.chat) for q in (0.5, 0.9)]
            ratio = pct(both.chat, 0.9) / pct(idle.chat, 0.9)
            floor = (
                f"{floor_ratio(pct(idle.chat, 0.9), args.batch_prompt, args.time_scale):>5.2f}x"
                if args.model.startswith("sim:")
                else f"{'-':>6}"
            )
            print(f"{label:<14} {ms[0]:>8.0f}/{ms[1]:<5.0f}ms {ms[2]:>9.0f}/{ms[3]:<5.0f}ms "
                  f"{ratio:>5.2f}x {floor} {alone.batch_tokens / args.seconds:>18.0f} "
                  f"{both.batch_tokens / args.seconds:>10.0f} "
                  f"{1000 * pct(both.batch_ttft, 0.99):>13.0f}ms"
                  f"  ({len(both.chat)} probes)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
