"""End to end: the real front door over two real replicas, ``kv`` routing vs the baselines.

    python benchmarks/bench_serve.py [--requests 120] [--concurrency 8] [--policies ...]

Why end to end: the router's hit rate in ``kvroute simulate`` assumes the engines cache
what the index says they do. Here the same seeded request sequence goes through the whole
system -- the official ``openai`` client (streaming), the FastAPI app under uvicorn, the
policy, Ray replica actors with paged-KV engines publishing KV events over ZeroMQ -- once
per policy, and the hit rate is what the engines themselves report
(``usage.prompt_tokens_details.cached_tokens``).

Workload: several tenants (one API key each, so each has its own cache salt) with a long
shared system prompt each, zipf popularity, and a short unique question per request.
Runs are independent: the replicas' prefix caches are reset and a fresh front door (empty
index, the policy under test) is started before each policy. Progress goes to stderr; the
table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import openai
import ray
import uvicorn

from kvroute.replica.actor import start_replica
from kvroute.router.frontdoor import FrontDoor
from kvroute.router.server import REPLICA_HEADER, create_app
from kvroute.router.tenants import Tenants

MODEL = "tiny"
BLOCK_SIZE = 16
_WORD_TEXT = (
    "the router sends each request to a replica that already holds its prefix in cache "
    "while engines publish block events and the index follows them so a shared system "
    "prompt is computed once per replica instead of once per request under load with "
    "tenants salts policies queues tokens latency throughput memory pages"
)
WORDS = _WORD_TEXT.split()


def _say(msg: str) -> None:
    print(f"bench_serve: {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Req:
    tenant: int
    prompt: str


@dataclass(slots=True)
class Result:
    replica: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


def _text(rng: random.Random, n_chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < n_chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)


def make_workload(seed: int, n: int, tenants: int, zipf_s: float) -> tuple[list[str], list[Req]]:
    """Tenants' system prompts (600-900 chars = tokens of the byte-level ``tiny``) and ``n``
    requests: a zipf-chosen tenant's prompt plus a unique question."""
    rng = random.Random(seed)
    systems = [
        f"System prompt of tenant {t}. " + _text(rng, rng.randint(600, 900)) + "\n"
        for t in range(tenants)
    ]
    weights = [1 / (t + 1) ** zipf_s for t in range(tenants)]
    reqs = []
    for i in range(n):
        t = rng.choices(range(tenants), weights)[0]
        question = f"Question {i}: " + _text(rng, rng.randint(30, 80)) + "?"
        reqs.append(Req(t, systems[t] + question))
    return systems, reqs


def ideal_cached(reqs: list[Req], tokenizer: Any) -> int:
    """Cached tokens one unbounded cache would serve in this order: each request's longest
    block-aligned prefix shared with an earlier one (one token is always computed)."""
    seen: dict[int, list[int]] = {}
    total = 0
    for r in reqs:
        ids = tokenizer(r.prompt).input_ids
        prev = seen.get(r.tenant)
        if prev is not None:
            lcp = 0
            for a, b in zip(ids, prev, strict=False):
                if a != b:
                    break
                lcp += 1
            total += min(lcp, len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
        seen[r.tenant] = ids
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serving(door: FrontDoor, tenants: Tenants) -> Iterator[str]:
    """The front door app under uvicorn on a thread (as tests/router/test_server.py does);
    yields its base URL and stops it (closing ``door``) on exit."""
    port = free_port()
    config = uvicorn.Config(
        create_app(door, tenants), host="127.0.0.1", port=port, log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(15)


async def send_all(
    url: str, keys: list[str], reqs: list[Req], concurrency: int, max_tokens: int
) -> list[Result]:
    """Sends ``reqs`` in order, at most ``concurrency`` at once, streaming; TTFT is from the
    call to the response's headers (see below)."""
    clients = [
        openai.AsyncOpenAI(base_url=url, api_key=k, max_retries=0, timeout=120) for k in keys
    ]
    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def one(r: Req) -> Result:
        nonlocal done
        async with sem:
            t0 = time.perf_counter()
            raw = await clients[r.tenant].completions.with_raw_response.create(
                model=MODEL,
                prompt=r.prompt,
                max_tokens=max_tokens,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            # The front door answers only once the replica produced the first token
            # (FrontDoor.open), so the headers' arrival is the first token's, as a client
            # sees it; the first text chunk can come later (the byte-level detokenizer
            # holds back a partial UTF-8 character).
            ttft = time.perf_counter() - t0
            replica = raw.headers[REPLICA_HEADER]
            usage = None
            async for chunk in raw.parse():
                if chunk.usage is not None:
                    usage = chunk.usage
        assert usage is not None, "a stream without usage"
        details = usage.prompt_tokens_details
        cached = (details.cached_tokens or 0) if details is not None else 0
        done += 1
        if done % 20 == 0:
            _say(f"  {done}/{len(reqs)} done")
        return Result(replica, usage.prompt_tokens, cached, ttft)

    try:
        return list(await asyncio.gather(*(one(r) for r in reqs)))
    finally:
        for c in clients:
            await c.close()


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tenants", type=int, default=6)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--num-blocks", type=int, default=192, help="KV blocks per replica")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--policies", default="kv,round_robin,random,least_loaded,approx_text")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    policies = args.policies.split(",")

    load_before = os.getloadavg()
    systems, reqs = make_workload(args.seed, args.requests, args.tenants, args.zipf)
    keys = [f"key-{t}" for t in range(args.tenants)]
    tenants = Tenants({k: f"tenant-{t}" for t, k in enumerate(keys)}, "bench-secret")
    per_tenant = Counter(r.tenant for r in reqs)
    _say(
        f"{len(reqs)} requests, {args.tenants} tenants (system prompts "
        f"{min(map(len, systems))}-{max(map(len, systems))} chars; requests per tenant "
        f"{[per_tenant[t] for t in range(args.tenants)]}), concurrency {args.concurrency}"
    )
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    rows: list[str] = []
    try:
        config = {"model": MODEL, "block_size": BLOCK_SIZE, "num_blocks": args.num_blocks}
        cpus = 1.8 / args.replicas  # leave Ray a little room on 2 CPUs
        actors = [
            start_replica(f"r{i}", config, num_cpus=cpus, torch_threads=1)
            for i in range(args.replicas)
        ]
        infos = ray.get([a.info.remote() for a in actors], timeout=180)
        _say(f"{len(actors)} replicas up ({infos[0].num_blocks} KV blocks each)")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(infos[0].model_path)
        ideal = ideal_cached(reqs, tokenizer)
        fleet = list(zip(actors, infos, strict=True))

        # Warm-up (allocator, first forward passes), on prompts no tenant uses; reset after.
        warm = [Req(0, f"warm-up {i} " + "x" * 300) for i in range(2 * len(actors))]
        door = FrontDoor(fleet, policy="round_robin", tokenizer=tokenizer)
        with serving(door, tenants) as url:
            asyncio.run(send_all(url, keys, warm, 2, args.max_tokens))

        for policy in policies:
            ok = ray.get([a.reset_prefix_cache.remote() for a in actors], timeout=30)
            if not all(ok):
                raise RuntimeError(f"prefix cache reset refused (blocks in use): {ok}")
            door = FrontDoor(fleet, policy=policy, tokenizer=tokenizer)
            _say(f"policy {policy}: sending {len(reqs)} requests")
            with serving(door, tenants) as url:
                t0 = time.perf_counter()
                results = asyncio.run(send_all(url, keys, reqs, args.concurrency, args.max_tokens))
                wall = time.perf_counter() - t0
            prompt = sum(r.prompt_tokens for r in results)
            cached = sum(r.cached_tokens for r in results)
            ttft = [r.ttft_s * 1000 for r in results]
            per = Counter(r.replica for r in results)
            split = " / ".join(str(per.get(f"r{i}", 0)) for i in range(len(actors)))
            _say(f"policy {policy}: hit rate {cached / prompt:.1%}, wall {wall:.1f} s")
            rows.append(
                f"| {policy} | {len(results)} | {prompt:,} | {cached:,} | "
                f"{cached / prompt:.1%} | {statistics.fmean(ttft):.1f} | "
                f"{pct(ttft, 0.5):.1f} | {pct(ttft, 0.9):.1f} | {wall:.1f} | {split} |"
            )
    finally:
        ray.shutdown()
    load_after = os.getloadavg()

    total_prompt = sum(len(tokenizer(r.prompt).input_ids) for r in reqs)
    print(
        "| policy | requests | prompt tokens | cached tokens | hit rate | TTFT mean ms | "
        "TTFT p50 ms | TTFT p90 ms | wall s | requests per replica (r0 / r1) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    print("\n".join(rows))
    print(
        f"\nideal (one unbounded cache, same order): {ideal:,} of {total_prompt:,} prompt "
        f"tokens cached ({ideal / total_prompt:.1%})"
    )
    la = " ".join(f"{x:.2f}" for x in load_before), " ".join(f"{x:.2f}" for x in load_after)
    print(
        f"machine: {os.cpu_count()} CPUs; load average before {la[0]}, after {la[1]}; "
        f"{args.replicas} replicas of {MODEL}, {args.num_blocks} KV blocks "
        f"({args.num_blocks * BLOCK_SIZE:,} tokens) each, concurrency {args.concurrency}, "
        f"max_tokens {args.max_tokens}, seed {args.seed}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
