"""Prefix fetch live on this CPU: the same long prompt's time to first token when its replica
recomputes it, and when it fetches the prefix from the replica that holds it, side by side.

    python benchmarks/bench_prefix_fetch.py --model smollm2-135m --prefix-tokens 4096

Two replicas (real Ray actors, a transfer plane each, one torch thread), the real front
door with ``prefix_fetch`` under uvicorn, streaming over HTTP. Each trial takes a fresh
prompt (distinct random tokens: cached nowhere) and runs it twice, greedy:

1. ``recompute``: the other replica cordoned, the prompt goes to the idle holder-to-be and
   is computed from scratch;
2. ``fetch``: the holder cordoned (as busy as a holder can be), the same prompt goes to the
   other replica, which pulls the prompt's full blocks from the holder over ZeroMQ and
   computes only the tail.

Both texts must be equal (the fetch's exactness), and the second must have been routed
with reason ``fetch``. The roles alternate between trials. Reported: TTFT per trial and
its median for each, their ratio (issue 51's goal: fetch <= 1/3 of recompute), the bytes
pulled and the link's measured speed. Wall time on a shared 2-core VM.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import sys
import threading
import time
from typing import Any

import httpx
import ray
import uvicorn

from kvroute.deploy.http_server import uvicorn_config
from kvroute.replica.serve.actor import start_replica
from kvroute.router.api.app import create_app
from kvroute.router.fleet.tenants import Tenants, tenants_from_api_keys
from kvroute.router.frontdoor import FrontDoor


def say(msg: str) -> None:
    print(f"bench_prefix_fetch: {msg}", file=sys.stderr, flush=True)


def ttft_and_text(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, str]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True}  # fmt: skip
    headers = {"Authorization": "Bearer bench-key"}
    t0 = time.perf_counter()
    first, text = None, []
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers,
                      timeout=600) as r:  # fmt: skip
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            piece = chunk["choices"][0]["text"]
            if first is None and piece:
                first = time.perf_counter() - t0
            text.append(piece)
    return (first if first is not None else time.perf_counter() - t0), "".join(text)


def fetches(door: FrontDoor) -> int:
    children = door.metrics.routing.children
    return int(sum(c.value for (_, reason), c in children.items() if reason == "fetch"))


def link_of(door: FrontDoor, rid: str) -> float:
    report = door.fleet.load.last_report(rid)
    return report.kv_link_bytes_per_s if report is not None else 0.0


def wait_indexed(door: FrontDoor, rid: str, blocks: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while door.fleet.index.num_blocks(rid) < blocks and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    n = args.prefix_tokens
    num_blocks = (n + args.max_tokens) // args.block_size + 64
    config = {"model": args.model, "block_size": args.block_size, "num_blocks": num_blocks,
              "kv_transfer": True}  # fmt: skip
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning",
             log_to_driver=False)  # fmt: skip
    say(f"starting 2 replicas of {args.model} ({num_blocks} blocks each)")
    actors = [start_replica(f"r{i}", config, num_cpus=0.5, torch_threads=1) for i in range(2)]
    infos = ray.get([a.info.remote() for a in actors], timeout=600)
    door = FrontDoor(list(zip(actors, infos, strict=True)), monitor_interval_s=0.5,
                     prefix_fetch=True)  # fmt: skip
    tenants = Tenants(tenants_from_api_keys({"bench-key": "bench"}), "bench-secret", None)
    app = create_app(door, tenants)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, 30.0, host="127.0.0.1", port=port))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.1)
    url = f"http://127.0.0.1:{port}"
    model = infos[0].model
    ids = [i.replica_id for i in infos]
    rng = random.Random(0)
    vocab = min(i.vocab_size or 32000 for i in infos)
    rows: list[dict[str, Any]] = []
    try:
        ttft_and_text(url, model, [rng.randrange(3, vocab - 1) for _ in range(64)], 2)  # warm
        for t in range(args.trials):
            holder, other = ids[t % 2], ids[(t + 1) % 2]
            prompt = [rng.randrange(3, vocab - 1) for _ in range(n)]
            door.fleet.cordon(other)
            rec_s, rec_text = ttft_and_text(url, model, prompt, args.max_tokens)
            door.fleet.cordon(other, False)
            wait_indexed(door, holder, (n - 1) // args.block_size)
            before = fetches(door)
            pulled = ray.get(actors[ids.index(other)].stats.remote())
            door.fleet.cordon(holder)
            fetch_s, fetch_text = ttft_and_text(url, model, prompt, args.max_tokens)
            door.fleet.cordon(holder, False)
            after = ray.get(actors[ids.index(other)].stats.remote())
            blocks = after.get("kv_pull_blocks", 0) - pulled.get("kv_pull_blocks", 0)
            row = {
                "trial": t, "recompute_ttft_s": rec_s, "fetch_ttft_s": fetch_s,
                "ratio": fetch_s / rec_s, "same_text": fetch_text == rec_text,
                "routed_fetch": fetches(door) - before, "blocks_pulled": blocks,
                "link_gb_s": link_of(door, other) / 1e9,
            }  # fmt: skip
            rows.append(row)
            say(
                f"trial {t}: recompute {rec_s:.2f} s, fetch {fetch_s:.3f} s "
                f"({row['ratio']:.3f}x), same text {row['same_text']}, "
                f"{blocks} blocks pulled, routed fetch {row['routed_fetch']}"
            )
            ray.get([a.reset_prefix_cache.remote() for a in actors])
    finally:
        server.should_exit = True
        ray.shutdown()
    rec = statistics.median(r["recompute_ttft_s"] for r in rows)
    fet = statistics.median(r["fetch_ttft_s"] for r in rows)
    block_bytes = infos[0].cost.kv_bytes_per_token * args.block_size if infos[0].cost else 0
    print(f"model {args.model}, prefix {n} tokens, {args.trials} trials, 2-vCPU VM")
    print(f"{'':>10} {'TTFT median':>12}")
    print(f"{'recompute':>10} {rec:>11.3f}s")
    print(f"{'fetch':>10} {fet:>11.3f}s   ratio {fet / rec:.3f} (goal <= 0.333)")
    mb = statistics.median(r["blocks_pulled"] for r in rows) * block_bytes / 1e6
    same = all(r["same_text"] for r in rows)
    routed = all(r["routed_fetch"] == 1 for r in rows)
    print(f"every text identical: {same}; every fetch routed so: {routed}; MB pulled: {mb:.0f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
