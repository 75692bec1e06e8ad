"""Chaos on the event streams: under 50 streaming clients, every replica's KV events reach
the router through a proxy that drops some messages, delays others at random (so they
also arrive out of order). Serving must not notice, and once the proxies are fair again
the router's index of every replica must equal that replica's cache: gaps are found by
sequence number and filled by replay or a snapshot, late duplicates are ignored.

    python -m pytest -s tests/router/fleet/test_event_chaos.py   # prints the counts
"""

from __future__ import annotations

import asyncio
import heapq
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import ray
import zmq

from kvroute.replica.serve.actor import start_replica
from kvroute.router.frontdoor import FrontDoor

from ...ray_session import local_ray
from ...waiting import wait_for
from ..served import Served, serve

MODEL = "sim:h100-8b"
SIM = {"model": MODEL, "block_size": 16, "num_blocks": 512, "time_scale": 4.0}
CLIENTS, SECONDS = 50, 20.0
DROP, MAX_DELAY_S = 0.05, 0.05
AUTH = {"Authorization": "Bearer key-a"}


class ChaosProxy:
    """Forwards a PUB stream: drops a share of messages, delays the rest by a random time
    (so later ones overtake earlier ones), until :meth:`calm` makes it a plain relay."""

    def __init__(self, upstream: str, seed: int) -> None:
        ctx = zmq.Context.instance()
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(upstream)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.rng = random.Random(seed)
        self.chaotic = True
        self.counts: Counter[str] = Counter()
        self._held: list[tuple[float, int, list[bytes]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def calm(self) -> None:
        self.chaotic = False

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            if self._sub.poll(5):
                frames = self._sub.recv_multipart()
                n += 1
                if self.chaotic and self.rng.random() < DROP:
                    self.counts["dropped"] += 1
                elif self.chaotic:
                    due = time.monotonic() + self.rng.uniform(0, MAX_DELAY_S)
                    heapq.heappush(self._held, (due, n, frames))
                    self.counts["delayed"] += 1
                else:
                    self._pub.send_multipart(frames)
                    self.counts["passed"] += 1
            now = time.monotonic()
            while self._held and (self._held[0][0] <= now or not self.chaotic):
                self._pub.send_multipart(heapq.heappop(self._held)[2])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sub.close(0)
        self._pub.close(0)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Served, list[ChaosProxy]]]:
    with local_ray() as started:
        proxies: list[ChaosProxy] = []
        try:
            actors = [start_replica(f"e{i}", SIM, num_cpus=0) for i in range(3)]
            started.extend(actors)
            infos = ray.get([a.info.remote() for a in actors], timeout=120)
            proxies = [ChaosProxy(i.events_endpoint, seed=n) for n, i in enumerate(infos)]
            routed = [
                msgspec.structs.replace(info, events_endpoint=p.endpoint)
                for info, p in zip(infos, proxies, strict=True)
            ]
            with serve(actors, infos=routed) as s:
                yield s, proxies
        finally:
            for p in proxies:
                p.close()


def prompt(c: int, n: int) -> list[int]:
    system = [(89 * (c % 6) + 11 * i) % 120_000 + 1 for i in range(96)]
    return system + [(c * 1000 + n * 7 + i) % 120_000 + 1 for i in range(24)]


async def drive(url: str) -> Counter[str]:
    end, outcomes = time.monotonic() + SECONDS, Counter[str]()

    async def client(http: httpx.AsyncClient, c: int) -> None:
        n = 0
        while time.monotonic() < end:
            body = {"model": MODEL, "prompt": prompt(c, n), "max_tokens": 6, "stream": True}
            async with http.stream("POST", url, json=body, headers=AUTH) as r:
                lines = [x async for x in r.aiter_lines() if x.startswith("data: ")]
            ok = r.status_code == 200 and lines[-1] == "data: [DONE]"
            ok = ok and not any('"error"' in x for x in lines)
            outcomes["ok" if ok else f"failed:{r.status_code}"] += 1
            n += 1

    limits = httpx.Limits(max_connections=CLIENTS + 4, max_keepalive_connections=CLIENTS + 4)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        await asyncio.gather(*(client(http, c) for c in range(CLIENTS)))
    return outcomes


def test_lost_delayed_and_reordered_events_heal(
    served: tuple[Served, list[ChaosProxy]],
) -> None:
    s, proxies = served
    door: FrontDoor = s.door
    outcomes = asyncio.run(drive(s.url + "/v1/completions"))
    for p in proxies:
        p.calm()
    chaos = sum((p.counts for p in proxies), Counter())
    stats = door.fleet.subscriber.stats()

    def converged() -> bool:
        truth = ray.get([a.cached_blocks.remote() for a in s.actors.values()], timeout=30)
        return all(door.fleet.index.counts(r) == t for r, t in zip(s.actors, truth, strict=True))

    wait_for(converged, 30, "the router's index equals every replica's cache")
    after = door.fleet.subscriber.stats()
    print(
        f"\nevent chaos {SECONDS:.0f} s, {CLIENTS} clients: requests {dict(outcomes)}; "
        f"event messages dropped {chaos['dropped']}, delayed {chaos['delayed']}; subscriber "
        f"gaps {sum(x.gaps for x in after.values())}, replays "
        f"{sum(x.replays for x in after.values())}, snapshots "
        f"{sum(x.snapshots for x in after.values())}, resets "
        f"{sum(x.resets for x in after.values())}; converged: index == cache for all 3"
    )
    assert set(outcomes) == {"ok"}  # serving never noticed
    assert chaos["dropped"] >= 10 and chaos["delayed"] >= 100
    assert sum(x.gaps for x in stats.values()) >= 1  # the losses were seen, then healed
    assert all(door.fleet.index.num_blocks(r) > 0 for r in s.actors)
