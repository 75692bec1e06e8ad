"""Fair share: one tenant floods at ten times its share while another sends its usual
requests; the other's TTFT p90 is compared with its figure on an idle fleet (goal: 2x).

What holds the flood back: at the front door each tenant may hold only its share of the
in-flight budget (past it, 429 with Retry-After, which the flooder honours as a greedy but
compliant client would); on each replica the waiting queue takes tenants in turn, and
while tenants compete for a step's prompt tokens the least-served tenant takes them first.
The replicas run as an operator of a multi-tenant fleet would set them:
``long_prefill_token_threshold`` 256 and ``max_num_partial_prefills`` 1, so no step
computes more than 256 prompt tokens of the flood, and the other tenant's prompt waits for
at most one such step, then has a step to itself. Cost-model replicas: the engine,
scheduler and queue are the real ones, the step times the model's. The flood runs in a
process of its own.

    python -m pytest -s tests/router/fleet/test_fair_share.py   # prints both figures

``KVROUTE_FAIR_SHARE_REPLICAS=tiny`` runs the same drill as a new user would try it: the real
``kvroute serve`` in a process of its own, one replica of the built-in ``tiny`` model (a real
forward pass on the CPU, one core), two API keys, the flood 20 clients against a share of 10.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray

from ...serve_process import kvroute_serve
from ...waiting import wait_for
from ..served import Served, serve_sim

MULTI_TENANT = {"long_prefill_token_threshold": 256, "max_num_partial_prefills": 1}
if os.environ.get("KVROUTE_FAIR_SHARE_REPLICAS") == "tiny":
    MODEL, VOCAB = "tiny", 250  # its byte-level vocabulary: ids 1..250 are all tokens
    CONFIG = {"model": MODEL, "block_size": 16, "num_blocks": 1024, **MULTI_TENANT}
    REPLICAS, BUDGET, SHARE, FLOODERS = 1, 20, 10, 20
else:
    MODEL, VOCAB = "sim:h100-8b", 120_000
    CONFIG = {"model": MODEL, "block_size": 16, "num_blocks": 4096, "time_scale": 4.0,
              **MULTI_TENANT}  # fmt: skip
    REPLICAS, BUDGET, SHARE, FLOODERS = 2, 24, 12, 120  # budget, each tenant's share of it
PROBES = 40
FLOOD, OTHER = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    if MODEL == "tiny":
        yield from kvroute_served(tmp_path_factory.mktemp("fair"))
        return
    with serve_sim("f", REPLICAS, CONFIG) as s:
        s.door.admission.max_in_flight, s.door.admission.shares.cap = BUDGET, SHARE
        yield s


def kvroute_served(tmp: Path) -> Iterator[Served]:
    """``kvroute serve`` in its own process: the front door shares no interpreter (and no
    GIL) with the probing client, as in production."""
    (tmp / "keys.json").write_text(json.dumps({"key-a": "a", "key-b": "b"}))
    args = ["--model", "tiny", "--replicas", "1", "--api-keys", str(tmp / "keys.json")]
    args += ["--max-in-flight", str(BUDGET), "--max-in-flight-per-tenant", str(SHARE)]
    args += ["--num-blocks", str(CONFIG["num_blocks"]), "--block-size", str(CONFIG["block_size"])]
    args += ["--long-prefill-token-threshold", str(MULTI_TENANT["long_prefill_token_threshold"])]
    args += ["--max-num-partial-prefills", str(MULTI_TENANT["max_num_partial_prefills"])]
    with kvroute_serve(args) as url:
        yield Served(url, None, {})  # type: ignore[arg-type]


REPLICA_TTFT: list[float] = []  # the other tenant's TTFT as its replica measured it
ROUTER_TTFT: list[float] = []  # ... and as the front door measured it


async def ttft(http: httpx.AsyncClient, url: str, auth: dict[str, str], body: dict) -> float:
    """Seconds to the first content chunk; raises on a refusal."""
    start = time.perf_counter()
    async with http.stream("POST", url, json={**body, "stream": True}, headers=auth) as r:
        if r.status_code != 200:
            await r.aread()
            raise PermissionError(r.headers.get("retry-after", "1"))
        first = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):  # the first token's chunk
                first = time.perf_counter() - start
            if line.startswith(": kvroute-timing ") and auth is OTHER:
                timing = json.loads(line.split(" ", 2)[2])
                REPLICA_TTFT.append(timing["replica_ttft_s"])
                ROUTER_TTFT.append(timing["router_ttft_s"])
    assert first is not None
    return first


def probe_body(i: int) -> dict:
    """Probe ``i``'s prompt: its own first block, so no probe hits another's cache."""
    return {"model": MODEL, "prompt": [(7 * i + j) % VOCAB + 1 for j in range(256)],
            "max_tokens": 4}  # fmt: skip


async def probes(http: httpx.AsyncClient, url: str, first: int) -> list[float]:
    out = []
    for i in range(first, first + PROBES):
        out.append(await ttft(http, url, OTHER, probe_body(i)))
        await asyncio.sleep(0.1)  # the other tenant's pace: a request now and then, no burst
    return out


FLOOD_SCRIPT = """
import asyncio, sys, httpx
url, clients, key, vocab = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
async def flooder(http, c):
    n = 0
    while True:
        body = {"model": "MODEL_NAME", "max_tokens": 64, "stream": True,
                "prompt": [(c * 977 + n * 31 + j) % vocab + 1 for j in range(2048)]}
        async with http.stream("POST", url, json=body,
                               headers={"Authorization": "Bearer " + key}) as r:
            if r.status_code == 429:  # back off as Retry-After says
                await r.aread()
                print("refused", flush=True)
                await asyncio.sleep(float(r.headers.get("retry-after", "1")))
            else:
                async for _ in r.aiter_lines():
                    pass
                print("served", flush=True)
        n += 1
async def main():
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        await asyncio.gather(*(flooder(http, c) for c in range(clients)))
asyncio.run(main())
""".replace("MODEL_NAME", MODEL)


def run(url: str, flood: bool) -> tuple[list[float], int, int]:
    """The other tenant's TTFTs; the flooder's served and refused requests. The flood
    runs in a process of its own, as a real client would: its CPU is not the server's."""
    proc, reader, lines = None, None, []
    if flood:
        args = [sys.executable, "-c", FLOOD_SCRIPT, url, str(FLOODERS), "key-a", str(VOCAB)]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)

        def read(out: Any) -> None:
            for line in out:  # "served" or "refused", one per flood request
                lines.append(line)

        reader = threading.Thread(target=read, args=(proc.stdout,), daemon=True)
        reader.start()
    try:
        if flood:  # the flood is on before the first probe: the flooder holds its whole share
            wait_for(lambda: "refused\n" in lines, 60, "the flooder refused past its share")

        async def probe_all() -> list[float]:
            async with httpx.AsyncClient(timeout=120) as http:
                return await probes(http, url, PROBES if flood else 0)

        result = asyncio.run(probe_all())
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
            reader.join(10)  # type: ignore[union-attr]
    return result, lines.count("served\n"), lines.count("refused\n")


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def test_a_flooding_tenant_leaves_another_within_2x_of_its_idle_ttft(served: Served) -> None:
    url = served.url + "/v1/completions"
    idle, _, _ = run(url, flood=False)
    idle_replica, idle_router = REPLICA_TTFT[:], ROUTER_TTFT[:]
    REPLICA_TTFT.clear()
    ROUTER_TTFT.clear()
    loaded, done, refused = run(url, flood=True)
    loaded_replica, loaded_router = REPLICA_TTFT[:], ROUTER_TTFT[:]
    ratio = p90(loaded) / p90(idle)
    stats = ray.get([a.stats.remote() for a in served.actors.values()]) if served.actors else []
    late = sum(s.get("late_steps", 0) for s in stats)
    steps = sum(s["steps"] for s in stats)
    ms = [f"{p90(xs) * 1000:.0f}" for xs in (idle_router, loaded_router)]
    print(
        f"\nfair share ({MODEL}): flooder {FLOODERS} clients, share {SHARE}: {done} served, "
        f"{refused} refused with 429; other tenant TTFT p90 idle {p90(idle) * 1000:.0f} ms, "
        f"under the flood {p90(loaded) * 1000:.0f} ms ({ratio:.2f}x); at its replica "
        f"{p90(idle_replica) * 1000:.0f} -> {p90(loaded_replica) * 1000:.0f} ms, at the front "
        f"door {ms[0]} -> {ms[1]} ms"
        + (f"; replicas ran {steps} steps, {late} late (the CPU could not keep up with the "
           "modelled time)" if stats else "")
    )  # fmt: skip
    assert refused > 0 and done > 0  # the flood was real, and served up to its share
    # The goal is 2x; measured 1.83-1.94x (BENCHMARKS.md, "Reliability drills"): the step in
    # progress when the request arrives, then its own step. This looser bound guards
    # against a regression without timing the machine (equal shares gave 2.7x, FCFS 10x+).
    assert ratio <= 4.0
