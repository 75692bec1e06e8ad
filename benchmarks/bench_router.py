"""Router hot path: event ingestion, routing decision latency, and Ray Serve's PrefixTree.

    python benchmarks/bench_router.py [--replicas 64] [--blocks 1000000] [--prompt-tokens 8192]

1. Ingestion: BlockStored / BlockRemoved batches of 64 blocks (the engine's per-step shape)
   applied to a PrefixIndex until it holds ``--blocks`` distinct hashes over ``--replicas``
   replicas (a quarter of the chains shared by 4 replicas); block events per second.
2. Decision: ``KVPolicy.choose`` (index walk + per-replica cost) and ``route`` (plus load
   accounting and predictions) for a ``--prompt-tokens`` prompt whose hashes are given,
   against that index; p50 / p99 over ``--decisions`` requests.
3. Same stream through Ray Serve's ``PrefixTree`` (prefix_match + insert on the prompt
   text, ~5 characters per token) and through kvroute (hash the tokens + match + predict),
   per request, if ``ray[serve]`` is importable.

Also printed: the machine's load average before and after (these figures move with it), and
one full garbage collection timed with the index alive and again once it is dropped (what
is left is the benchmark's own request chains), so the index's share of a GC pause shows.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import time

from kvroute.events import BlockHasher, BlockRemoved, BlockStored, EventBatch
from kvroute.router.routing.index import PrefixIndex, prediction_stride
from kvroute.router.routing.policy import KVPolicy, RequestView

BS = 16


def chain(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


def ingest(replicas: int, blocks: int, chain_blocks: int) -> tuple[PrefixIndex, dict, list]:
    """Fill an index to ``blocks`` distinct hashes; returns (index, rates, chains held)."""
    index = PrefixIndex(max_blocks_per_replica=4 * blocks)
    ids = [f"replica-{i}" for i in range(replicas)]
    rng = random.Random(0)
    batches: list[tuple[str, EventBatch]] = []
    held: list[tuple[list[bytes], list[str]]] = []
    distinct = 0
    while distinct < blocks:
        hs = chain(chain_blocks)
        owners = rng.sample(ids, 4) if rng.random() < 0.25 else [rng.choice(ids)]
        held.append((hs, owners))
        distinct += len(hs)
        for rid in owners:
            for i in range(0, len(hs), 64):
                parent = hs[i - 1] if i else None
                ev = BlockStored(hs[i : i + 64], parent, [], BS, None, "GPU", None)
                batches.append((rid, EventBatch(0.0, [ev])))
    n_events = sum(len(b.events[0].block_hashes) for _, b in batches)
    t = time.perf_counter()
    for rid, b in batches:
        index.apply(rid, b)
    store_rate = n_events / (time.perf_counter() - t)
    # churn: remove and re-store 10% of the chains (64-block batches)
    victims = held[: len(held) // 10]
    removes = [
        (rid, EventBatch(0.0, [BlockRemoved(hs[i : i + 64], "GPU")]))
        for hs, owners in victims
        for rid in owners
        for i in range(0, len(hs), 64)
    ]
    n_rm = sum(len(b.events[0].block_hashes) for _, b in removes)
    t = time.perf_counter()
    for rid, b in removes:
        index.apply(rid, b)
    remove_rate = n_rm / (time.perf_counter() - t)
    for hs, owners in victims:  # put them back so the index holds ``blocks`` again
        for rid in owners:
            for i in range(0, len(hs), 64):
                parent = hs[i - 1] if i else None
                ev = BlockStored(hs[i : i + 64], parent, [], BS, None, "GPU", None)
                index.apply(rid, EventBatch(0.0, [ev]))
    return index, {"store_blocks_per_s": store_rate, "remove_blocks_per_s": remove_rate}, held


def decisions(
    index: PrefixIndex, held: list, replicas: int, prompt_blocks: int, n: int, rate: float = 0.0
) -> dict:
    """``rate`` > 0: request k is routed at time k / rate, so predictions expire (10 s) as
    in a router; 0: all at time 0, nothing expires and the prediction map only grows."""
    ids = [f"replica-{i}" for i in range(replicas)]
    policy = KVPolicy(index, seed=0)
    rng = random.Random(1)
    choose, route = [], []
    for k in range(n):
        hs, _ = rng.choice(held)
        keep = rng.randint(0, min(len(hs), prompt_blocks))
        hashes = hs[:keep] + chain(prompt_blocks - keep)
        req = RequestView(f"q{k}", prompt_blocks * BS + 1, hashes, BS)
        now = k / rate if rate > 0 else 0.0
        t = time.perf_counter_ns()
        policy.choose(req, ids, now)
        choose.append(time.perf_counter_ns() - t)
        t = time.perf_counter_ns()
        policy.route(req, ids, now)
        route.append(time.perf_counter_ns() - t)
        policy.on_finished(req.request_id, now)
    q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] / 1000  # noqa: E731
    return {
        "choose_p50_us": q(choose, 50),
        "choose_p99_us": q(choose, 99),
        "route_p50_us": q(route, 50),
        "route_p99_us": q(route, 99),
        "route_max_us": max(route) / 1000,
    }


def versus_ray(replicas: int, prompt_tokens: int, warm: int, n: int) -> dict | None:
    try:
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree
    except ImportError as e:
        print(f"# Ray Serve PrefixTree not importable ({e}); skipped", file=sys.stderr)
        return None
    rng = random.Random(2)
    ids = [f"replica-{i}" for i in range(replicas)]
    half = prompt_tokens // 2
    systems = [[rng.randrange(32000) for _ in range(half)] for _ in range(64)]
    stream = []
    for _ in range(warm + n):
        s = rng.randrange(len(systems))
        toks = systems[s] + [rng.randrange(32000) for _ in range(prompt_tokens - half)]
        stream.append((toks, " ".join(f"w{t}" for t in toks), ids[s % replicas]))
    tree = PrefixTree()
    tree.add_tenants(ids, 0.0)
    hasher = BlockHasher(block_size=BS)
    index = PrefixIndex()
    policy = KVPolicy(index, seed=0)
    ray_ns, kv_ns = [], []
    for k, (toks, text, rid) in enumerate(stream):
        t = time.perf_counter_ns()
        tree.prefix_match(text)
        tree.insert(text, rid, float(k))
        dt_ray = time.perf_counter_ns() - t
        t = time.perf_counter_ns()
        req = RequestView(f"q{k}", len(toks), hasher.hash_blocks(toks), BS)
        policy.route(req, ids, float(k) * 1e-3)
        dt_kv = time.perf_counter_ns() - t
        policy.on_finished(req.request_id, 0.0)
        if k >= warm:
            ray_ns.append(dt_ray)
            kv_ns.append(dt_kv)
    ray_ms = statistics.median(ray_ns) / 1e6
    kv_ms = statistics.median(kv_ns) / 1e6
    return {"ray_prefixtree_ms": ray_ms, "kvroute_ms": kv_ms, "ratio": ray_ms / kv_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument(
        "--decision-rate",
        type=float,
        default=0.0,
        help="requests/s of the decisions' own clock (predictions expire); 0: all at time 0",
    )
    ap.add_argument("--ray-warm", type=int, default=300)
    ap.add_argument("--ray-requests", type=int, default=300)
    ap.add_argument(
        "--gc",
        choices=("on", "freeze", "off"),
        default="on",
        help="during decisions: default GC, gc.freeze() of the built index, or GC disabled",
    )
    args = ap.parse_args()
    print(
        f"# python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} cpus; "
        f"load average {_load()} at start"
    )
    pb = args.prompt_tokens // BS
    index, rates, held = ingest(args.replicas, args.blocks, pb)
    print(
        f"ingestion: {len(index):,} distinct hashes over {args.replicas} replicas; "
        f"stores {rates['store_blocks_per_s']:,.0f} blocks/s, "
        f"removes {rates['remove_blocks_per_s']:,.0f} blocks/s (64-block batches)"
    )
    with_index = full_gc_ms()
    if args.gc == "freeze":
        gc.freeze()  # what a router process can do once its index is warm
    elif args.gc == "off":
        gc.disable()
    # Predictions of every block (the baseline), then sampled as a front door samples them
    # for BS-token blocks (prediction_stride); the first run's predictions expired between.
    for stride in (1, prediction_stride(BS)):
        index.prediction_stride = stride
        d = decisions(index, held, args.replicas, pb, args.decisions, args.decision_rate)
        index.match(held[0][0][:1], now=1e9)  # expires every prediction
        print(
            f"decision, {args.prompt_tokens}-token prompt ({pb} hashes given), "
            f"{args.replicas} replicas, gc {args.gc}, predictions every {stride} block(s)"
            + (f", {args.decision_rate:g} req/s" if args.decision_rate else "")
            + ": "
            f"choose p50 {d['choose_p50_us']:.0f} us, p99 {d['choose_p99_us']:.0f} us; "
            f"route (+ accounting, predictions) p50 {d['route_p50_us']:.0f} us, "
            f"p99 {d['route_p99_us']:.0f} us, max {d['route_max_us']:.0f} us"
        )
    gc.enable()
    gc.unfreeze()  # (a no-op unless frozen) so the GC pass timed below walks everything
    del index
    print(
        f"full gc pass: {with_index:.1f} ms with the index alive, {full_gc_ms():.1f} ms once "
        f"it is dropped (the benchmark's own {len(held):,} request chains)"
    )
    del held
    r = None
    if args.ray_requests > 0:
        r = versus_ray(args.replicas, args.prompt_tokens, args.ray_warm, args.ray_requests)
    if r is not None:
        print(
            f"same stream, per request (median): Ray Serve PrefixTree prefix_match+insert "
            f"{r['ray_prefixtree_ms']:.2f} ms; kvroute hash+match+predict "
            f"{r['kvroute_ms']:.2f} ms; ratio {r['ratio']:.1f}x"
        )
    print(f"# load average {_load()} at end")


def full_gc_ms() -> float:
    """One full collection, timed: what a router pays whenever the collector reaches gen 2."""
    gc.collect()  # settle first, so the timed pass walks what is alive, not fresh garbage
    t = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - t) * 1e3


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
