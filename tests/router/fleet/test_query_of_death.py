"""Queries of death: a request that fails its own stage fails alone, and a request that
kills an engine is never replayed onto a second replica.

Why replicas armed from the inside: after the edge validation no valid HTTP request is known
to crash an engine, yet the next one will exist. So each replica here runs a real engine
whose runner or sampler is rigged to fail on a marker sequence of prompt tokens -- in the
shared forward (the engine dies) or in the request's own sampling (the request fails).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import openai
import pytest
import ray
import ray.cloudpickle

from kvroute.replica.serve.actor import ReplicaServer

from ...ray_session import local_ray
from ...waiting import wait_for
from ..served import MODEL, Served, serve

CONFIG = {"model": MODEL, "block_size": 16, "num_blocks": 64, "device": "cpu"}
MARKER = [201, 202, 203, 204]
AUTH = {"Authorization": "Bearer key-a"}


def _contains(ids: Sequence[int], marker: Sequence[int]) -> bool:
    n = len(marker)
    return any(list(ids[i : i + n]) == list(marker) for i in range(len(ids) - n + 1))


class RiggedReplica(ReplicaServer):
    """A replica whose engine fails on requests that carry ``MARKER`` (tests only)."""

    def rig(self, where: str, after: int = 0, hold: bool = False) -> None:
        """``where``: "process", "forward" or "sampler"; the sampler fails from a request's draw
        ``after`` on (0: its first token). ``hold``: that failing draw first waits for
        ``release`` -- so a test knows its client saw the earlier tokens before the failure,
        however the deltas of a slow machine coalesce."""
        engine = self.engine.llm_engine
        draws: dict[str, int] = {}
        released = self.released = threading.Event()
        if where == "process":  # the process dies with no word (a segfault, the OOM killer)
            execute = engine.runner.execute

            def execute_or_exit(sched: Any) -> Any:
                if any(_contains(s.request.prompt_token_ids, MARKER) for s in sched.scheduled):
                    os._exit(1)
                return execute(sched)

            engine.runner.execute = execute_or_exit
        elif where == "forward":  # shared state: the whole engine dies
            execute = engine.runner.execute

            def execute_or_die(sched: Any) -> Any:
                if any(_contains(s.request.prompt_token_ids, MARKER) for s in sched.scheduled):
                    raise RuntimeError("rigged forward failure")
                return execute(sched)

            engine.runner.execute = execute_or_die
        else:  # the request's own seed: only it fails
            sampler = engine.runner.sampler
            sampler.__dict__.pop("_generator", None)  # undo an earlier rig
            generator = sampler._generator

            def generator_or_fail(rid: str, params: Any) -> Any:
                draws[rid] = draws.get(rid, 0) + 1
                poisoned = _contains(engine.scheduler.requests[rid].prompt_token_ids, MARKER)
                if poisoned and draws[rid] > after:
                    if hold:
                        released.wait(60)
                    raise ValueError("rigged seed failure")
                return generator(rid, params)

            sampler._generator = generator_or_fail  # type: ignore[method-assign]

    def release(self) -> None:
        self.released.set()


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import it
RiggedActor = ray.remote(RiggedReplica)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with local_ray() as started:
        actors = [
            RiggedActor.options(num_cpus=0.5, max_restarts=-1, max_task_retries=0).remote(
                f"q{i}", CONFIG, "127.0.0.1", 1
            )
            for i in range(2)
        ]
        started.extend(actors)
        with serve(actors) as s:
            yield s


def client(served: Served, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=served.url + "/v1", api_key="key-a", max_retries=retries, timeout=60
    )


POISON = [5, 6, 7, *MARKER, 8, 9]


def test_a_request_failing_its_own_stage_fails_alone(served: Served) -> None:
    ray.get([a.rig.remote("sampler") for a in served.actors.values()])
    c = client(served)
    with pytest.raises(openai.InternalServerError) as err:
        c.completions.create(model=MODEL, prompt=POISON, max_tokens=4, temperature=0.8)
    body = err.value.response.json()["error"]
    assert body["code"] == "request_failed" and "seed failed: ValueError" in body["message"]
    assert body["request_id"] == err.value.response.headers["x-request-id"]
    # Streaming: it failed before its first token, so the status still says so.
    req = {"model": MODEL, "prompt": POISON, "max_tokens": 4, "temperature": 0.8, "stream": True}
    r = httpx.post(served.url + "/v1/completions", json=req, headers=AUTH, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed"
    # Failing after its first tokens were streamed: an error event, then [DONE].
    ray.get([a.rig.remote("sampler", after=3, hold=True) for a in served.actors.values()])
    with httpx.stream("POST", served.url + "/v1/completions", json=req, headers=AUTH) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        events = [next(line for line in lines if line.startswith("data: "))]
        ray.get([a.release.remote() for a in served.actors.values()])
        events += [line for line in lines if line and not line.startswith(":")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "request_failed" and error["request_id"] == r.headers["x-request-id"]
    assert len(events) >= 3  # text of the first tokens did arrive
    # Nothing else noticed: greedy requests (no draw) on the same prompt, and other prompts.
    ok = c.completions.create(model=MODEL, prompt=POISON, max_tokens=4, temperature=0)
    assert ok.usage.completion_tokens == 4
    assert served.door.errors["replica_failure"] == 0 and len(served.door.fleet.alive()) == 2


def test_a_query_of_death_never_takes_down_a_second_replica(served: Served) -> None:
    door = served.door
    before = {rid: ray.get(a.info.remote()).incarnation for rid, a in served.actors.items()}
    ray.get([a.rig.remote("forward") for a in served.actors.values()])
    # The official SDK retries a 503 by itself (twice here): the retry must be refused.
    with pytest.raises(openai.BadRequestError) as err:
        client(served, retries=2).completions.create(model=MODEL, prompt=POISON, max_tokens=4)
    body = err.value.response.json()["error"]
    assert body["code"] == "request_quarantined" and "fingerprint" in body["message"]
    assert door.errors["replica_failure"] == 1 and door.counters["retries"] == 0
    assert len(door.quarantine) == 1
    victim = next(rid for rid in served.actors if rid not in door.fleet.alive())
    (survivor,) = door.fleet.alive()
    assert ray.get(served.actors[survivor].info.remote()).incarnation == before[survivor]
    # However often its tenant sends it again, it is refused without reaching a replica.
    # (Another tenant's copy is that tenant's own fingerprint: see test_quarantine.py.)
    for _ in range(2):
        again = httpx.post(
            served.url + "/v1/completions",
            json={"model": MODEL, "prompt": POISON, "max_tokens": 4},
            headers=AUTH,
        )
        assert again.status_code == 400 and again.json()["error"]["code"] == "request_quarantined"
    # Other requests are served throughout, and the victim comes back.
    assert client(served).completions.create(model=MODEL, prompt="fine", max_tokens=2)
    assert door.errors["replica_failure"] == 1
    wait_for(lambda: victim in door.fleet.alive(), 60, "victim restarted and routable")
    assert ray.get(served.actors[victim].info.remote()).incarnation != before[victim]
    assert ray.get(served.actors[survivor].info.remote()).incarnation == before[survivor]


def test_a_request_that_kills_its_process_is_not_replayed(served: Served) -> None:
    """A process that dies gives no word about which request killed it (Ray raises the same
    error to every call in flight). The request was the only one there: it is not retried,
    and its fingerprint is refused at once, so not even the client's retry reaches a
    second replica."""
    door = served.door
    wait_for(lambda: len(door.fleet.alive()) == 2, 60, "both replicas routable")
    before = {rid: ray.get(a.info.remote()).incarnation for rid, a in served.actors.items()}
    retries, failures = door.counters["retries"], door.errors["replica_failure"]
    ray.get([a.rig.remote("process") for a in served.actors.values()])
    poison = [11, 12, *MARKER, 13]
    with pytest.raises(openai.BadRequestError) as err:
        client(served, retries=2).completions.create(model=MODEL, prompt=poison, max_tokens=4)
    assert err.value.response.json()["error"]["code"] == "request_quarantined"
    assert door.errors["replica_failure"] == failures + 1
    assert door.counters["retries"] == retries
    victim = next(rid for rid in served.actors if rid not in door.fleet.alive())
    (survivor,) = door.fleet.alive()
    assert ray.get(served.actors[survivor].info.remote()).incarnation == before[survivor]
    assert client(served).completions.create(model=MODEL, prompt="fine", max_tokens=2)
    wait_for(lambda: victim in door.fleet.alive(), 60, "victim restarted and routable")
