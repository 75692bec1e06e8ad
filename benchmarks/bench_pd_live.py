"""P/D live on this CPU: streams decoding while long prompts arrive, 1 prefill + 1 decode
replica against 2 whole-request replicas, side by side in one run.

Two whole-request baselines: ``unified`` (serve's defaults: a 2,000-token prompt is one
step of up to 2,048 tokens, which holds its replica's streams for the whole prefill: one
long gap per stream, seen in ITL p99.9 and max rather than p99) and ``chunked`` (a prompt's
chunks at most 256 tokens a step: many shorter gaps, which p99 sees).

    python benchmarks/bench_pd_live.py --model smollm2-135m --seconds 90 \
        [--fleets unified,chunked,pd,pairs]

Each fleet is a real ``kvroute serve`` (one torch thread per replica, a local Ray), fresh
for its run. The load is the same for both: ``--streams`` clients each stream a short
prompt (``--stream-prompt`` tokens, ``--stream-tokens`` out) and send the next when it
ends; every ``--long-every`` seconds a ``--long-tokens``-token prompt arrives (distinct
tokens: no cache hits) asking for ``--long-out`` tokens. Reported per fleet:

- ITL p50/p99/p99.9/max of the streams: the gap between consecutive chunks of a stream
  (one per engine step it got tokens in: what a long prefill sharing the streams' steps
  stretches; a stall is one gap per stream however long, so it shows in the tail's end);
- TTFT p50/p90 of the long prompts; TTFT p50 of the streams;
- output tokens per second over the run (all requests), and how many requests split
  (``kvroute:pd_handoffs_total``).

The issue's goals (issue 51, live): P/D's ITL p99 <= 1/5 of unified, TTFT p90 <= 1.3x,
output tok/s >= 0.9x. Wall time on a shared 2-core VM: the replicas, the front door and
this client share the cores in both runs alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_proc import start_serve, stop_serve

MODEL = ["smollm2-135m"]  # the served name (set from --model)
FLEETS = {
    "unified": ["--replicas", "2"],
    "pd": ["--prefill-replicas", "1", "--decode-replicas", "1"],
    "pairs": ["--replicas", "2", "--pd-split", "pair"],  # any two may split a request, priced
    # unified, as an operator who guards ITL runs it: a prompt's chunks at most 256 tokens
    # a step, so a long prompt's prefill shares many short steps with the streams' decodes
    # (vLLM's chunked prefill) instead of holding them for one long step
    "chunked": ["--replicas", "2", "--long-prefill-token-threshold", "256"],
}
BASELINES = ("unified", "chunked")  # the whole-request fleets the split ones are held against


def say(msg: str) -> None:
    print(f"bench_pd_live: {msg}", file=sys.stderr, flush=True)


@dataclass
class Samples:
    itl: list[float] = field(default_factory=list)  # streams: seconds per token between chunks
    stream_ttft: list[float] = field(default_factory=list)
    long_ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: int = 0
    streams_done: int = 0
    longs_done: int = 0


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


async def one(
    client: httpx.AsyncClient,
    url: str,
    prompt: list[int],
    max_tokens: int,
    out: Samples,
    long: bool,
) -> None:
    body = {"model": MODEL[0], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                out.errors += 1
                await r.aread()
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    out.errors += 1
                    return
                if ev.get("usage") and not ev.get("choices"):
                    out.tokens += ev["usage"]["completion_tokens"]
                    continue
                now = time.perf_counter()
                if last is None:
                    (out.long_ttft if long else out.stream_ttft).append(now - t0)
                elif not long:
                    out.itl.append(now - last)
                last = now
    except httpx.HTTPError:
        out.errors += 1
        return
    if long:
        out.longs_done += 1
    else:
        out.streams_done += 1


async def load(url: str, args: argparse.Namespace, seed: int) -> tuple[Samples, float]:
    rng = random.Random(seed)
    out = Samples()
    end = time.monotonic() + args.seconds

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(n)]

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def streamer() -> None:
            while time.monotonic() < end:
                await one(client, url, tokens(args.stream_prompt), args.stream_tokens, out, False)

        async def longs() -> None:
            tasks = []
            await asyncio.sleep(args.long_every / 2)
            while time.monotonic() < end:
                tasks.append(asyncio.create_task(
                    one(client, url, tokens(args.long_tokens), args.long_out, out, True)
                ))  # fmt: skip
                await asyncio.sleep(args.long_every)
            await asyncio.gather(*tasks)

        t0 = time.monotonic()
        await asyncio.gather(*(streamer() for _ in range(args.streams)), longs())
        return out, time.monotonic() - t0


def handoffs(base: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("kvroute:pd_handoffs_total "):
                return float(line.split()[1])
    return 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_fleet(name: str, args: argparse.Namespace, logdir: Path) -> dict[str, float]:
    port = free_port()
    cmd = ["kvroute", "serve", "--model", args.model, "--port", str(port), *FLEETS[name],
           "--max-num-batched-tokens", str(args.max_num_batched_tokens)]  # fmt: skip
    if name == "pd" and args.pd_split:
        cmd += ["--pd-split", args.pd_split]
    say(f"{name}: {' '.join(cmd)}")
    proc = start_serve(cmd, logdir / f"{name}.log", 900)
    base = f"http://127.0.0.1:{port}"
    try:
        # warm-up: one short and one long request, not counted
        asyncio.run(warm(base + "/v1/completions", args))
        out, seconds = asyncio.run(load(base + "/v1/completions", args, seed=1))
        split = handoffs(base)
    finally:
        stop_serve(proc, 60)
    return {
        "itl_p50_ms": 1e3 * pct(out.itl, 50),
        "itl_p99_ms": 1e3 * pct(out.itl, 99),
        "itl_p999_ms": 1e3 * pct(out.itl, 99.9),
        "itl_max_ms": 1e3 * max(out.itl, default=float("nan")),
        "stream_ttft_p50_s": pct(out.stream_ttft, 50),
        "long_ttft_p50_s": pct(out.long_ttft, 50),
        "long_ttft_p90_s": pct(out.long_ttft, 90),
        "out_tok_s": out.tokens / seconds,
        "streams": out.streams_done,
        "longs": out.longs_done,
        "errors": out.errors,
        "handoffs": split,
    }


async def warm(url: str, args: argparse.Namespace) -> None:
    out = Samples()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        await one(client, url, [5000 + i for i in range(args.stream_prompt)], 4, out, False)
        await one(client, url, [7000 + i for i in range(args.long_tokens)], 4, out, True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seconds", type=float, default=90.0)
    p.add_argument("--streams", type=int, default=6)
    p.add_argument("--stream-prompt", type=int, default=64)
    p.add_argument("--stream-tokens", type=int, default=128)
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--long-out", type=int, default=16)
    p.add_argument("--long-every", type=float, default=10.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--pd-split", choices=("priced", "always"), default=None)
    p.add_argument("--fleets", default="unified,pd")
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args()
    MODEL[0] = args.model
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.fleets.split(","):
            rows[name] = run_fleet(name, args, Path(tmp))
            say(f"{name}: {rows[name]}")
    cols = list(next(iter(rows.values())))
    print("| fleet | " + " | ".join(cols) + " |")
    print("| --- |" + " ---: |" * len(cols))
    for name, row in rows.items():
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for other, base in ((o, b) for o in ("pd", "pairs") for b in BASELINES):
        if base not in rows or other not in rows:
            continue
        u, d = rows[base], rows[other]
        print(
            f"\n{other} vs {base}: "
            f"ITL p99 {d['itl_p99_ms'] / u['itl_p99_ms']:.3f}x (goal <= 0.2), "
            f"long TTFT p90 {d['long_ttft_p90_s'] / u['long_ttft_p90_s']:.2f}x (goal <= 1.3), "
            f"output tok/s {d['out_tok_s'] / u['out_tok_s']:.2f}x (goal >= 0.9)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
