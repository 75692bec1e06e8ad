"""The HTTP front door when things go wrong: clients that leave (the request is aborted on its
replica), a bug after routing, overload as a 429 (for one tenant's burst too), and replicas
that fail before the first token or mid-stream (retried, failed over without a seam)."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import httpx
import openai
import pytest
import ray

from kvroute.router.api.app import REPLICA_HEADER

from ...prom import scrape, value
from ...waiting import wait_for
from ..served import assert_clean_error
from .http_fleet import AUTH, ENDLESS, LONG, MODEL, client, running


def test_client_disconnect_aborts_on_the_replica(fleet: dict[str, Any]) -> None:
    url = fleet["url"] + "/v1/completions"
    with httpx.stream(
        "POST", url, json={**ENDLESS, "prompt": "go", "stream": True}, headers=AUTH
    ) as r:
        assert r.headers[REPLICA_HEADER] in ("r0", "r1")
        lines = r.iter_lines()  # held: dropping the iterator would close the response
        assert next(lines).startswith("data: ")
        assert running(fleet) == 1
    wait_for(lambda: running(fleet) == 0, 3, "streamed request aborted")
    # Non-streaming: the handler notices the client left and cancels the request too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json={**ENDLESS, "prompt": "go on"}, headers=AUTH, timeout=1.0)
    wait_for(lambda: running(fleet) == 0, 3, "non-streamed request aborted")
    assert fleet["door"].fleet.load.in_flight() == 0


def test_a_stream_whose_client_leaves_before_its_first_token_gives_everything_back(
    fleet: dict[str, Any],
) -> None:
    """The stream's response waits for the first delta with the disconnect watch already
    on: a client gone by then ends the request on its replica and frees its slot, and no
    head is written for nobody."""
    door = fleet["door"]
    url = fleet["url"] + "/v1/completions"
    prompt = [(7 * i) % 250 for i in range(2000)]  # tens of ms of prefill on tiny
    for _ in range(3):
        with pytest.raises(httpx.ReadTimeout):
            body = {**ENDLESS, "max_tokens": 400, "prompt": prompt, "stream": True}
            httpx.post(url, json=body, headers=AUTH, timeout=httpx.Timeout(5, read=0.005))
        prompt = [t + 1 for t in prompt]  # a fresh prefix each time
    wait_for(lambda: running(fleet) == 0, 5, "requests left before their first token aborted")
    wait_for(lambda: door.fleet.load.in_flight() == 0, 3, "their slots given back")
    assert door.admission.in_flight == 0 and door.admission.tenant_in_flight("alpha") == 0


def test_a_failure_between_routing_and_the_response_gives_the_request_back(
    fleet: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request is already on its replica when the handler builds its response: a bug
    there is a 500, and the run is closed (aborted, its slot and ticket given back)."""
    import kvroute.router.api.responses as responses

    def broken(*args: Any) -> Any:
        raise RuntimeError("a bug while shaping logprobs")

    monkeypatch.setattr(responses, "Logprobs", broken)
    door = fleet["door"]
    for stream in (False, True):
        body = {**ENDLESS, "prompt": "x", "logprobs": 1, "stream": stream}
        r = httpx.post(fleet["url"] + "/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 500, r.text
    wait_for(lambda: running(fleet) == 0, 5, "both requests aborted on their replicas")
    assert door.fleet.load.in_flight() == 0 and door.admission.in_flight == 0


def test_overload_is_a_429_not_a_queue(fleet: dict[str, Any]) -> None:
    door = fleet["door"]
    door.admission.max_in_flight = 1
    try:
        url = fleet["url"] + "/v1/completions"
        with httpx.stream(
            "POST", url, json={**ENDLESS, "prompt": "a", "stream": True}, headers=AUTH
        ) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            with pytest.raises(openai.RateLimitError):
                client(fleet).completions.create(model=MODEL, prompt="b", max_tokens=1)
    finally:
        door.admission.max_in_flight = None
    wait_for(lambda: door.fleet.load.in_flight() == 0 and running(fleet) == 0, 3, "stream ended")


def test_one_tenants_burst_is_a_429_while_another_tenant_is_admitted(
    fleet: dict[str, Any],
) -> None:
    """Fair share at admission: alpha holds its share of the budget; its next request is a
    429 with Retry-After while the router still has room, and beta is admitted."""
    door = fleet["door"]
    door.admission.max_in_flight, door.admission.shares.cap = 3, 2
    url = fleet["url"] + "/v1/completions"
    try:
        with contextlib.ExitStack() as held:
            lines = []  # held: dropping an iterator would close its response
            for prompt in ("a", "b"):
                body = {**ENDLESS, "prompt": prompt, "stream": True}
                r = held.enter_context(httpx.stream("POST", url, json=body, headers=AUTH))
                lines.append(r.iter_lines())
                assert next(lines[-1]).startswith("data: ")
            assert door.admission.tenant_in_flight("alpha") == 2
            assert door.fleet.load.in_flight() == 2
            burst = httpx.post(
                url, json={"model": MODEL, "prompt": "c", "max_tokens": 1}, headers=AUTH
            )
            err = assert_clean_error(burst, 429)
            assert err["code"] == "rate_limit_exceeded" and burst.headers["retry-after"] == "1"
            beta = client(fleet, "key-b").completions.create(model=MODEL, prompt="d", max_tokens=1)
            assert beta.usage is not None and beta.usage.completion_tokens == 1
            assert door.admission.tenant_in_flight("beta") == 0  # released when its response ended
    finally:
        door.admission.max_in_flight, door.admission.shares.cap = None, None
    wait_for(lambda: door.fleet.load.in_flight() == 0 and running(fleet) == 0, 3, "streams ended")
    assert door.admission.tenant_in_flight("alpha") == 0


def test_replica_failure_before_first_token_is_retried_elsewhere(fleet: dict[str, Any]) -> None:
    """Last: it kills a replica. Its cached prefix draws the request; its engine fails on the
    next step; the router drops it, the request is served by the other one, and once Ray
    restarted it the monitor routes to it again."""
    c = client(fleet)
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "temperature": 0.0}
    prompt = "failure drill " + LONG
    victim = c.completions.with_raw_response.create(prompt=prompt, **kw).headers[REPLICA_HEADER]
    door = fleet["door"]
    wait_for(lambda: door.fleet.index.num_blocks(victim) >= 18, 10, "victim's events indexed")
    old = door.fleet.replicas[victim].info.incarnation
    routed_before = door.fleet.replicas[victim].routed
    ray.get(fleet["actors"][victim].inject_engine_failure.remote())
    resp = c.completions.with_raw_response.create(prompt=prompt, **kw)
    assert resp.headers[REPLICA_HEADER] != victim
    assert resp.parse().usage.completion_tokens == 2
    assert victim not in door.fleet.alive() and door.fleet.index.num_blocks(victim) == 0
    assert door.counters["retries"] == 1 and door.errors["replica_failure"] >= 1
    wait_for(lambda: door.fleet.replicas[victim].info.incarnation != old, 60, "replica restarted")
    wait_for(lambda: victim in door.fleet.alive(), 10, "replica routable again")
    assert httpx.get(fleet["url"] + "/health").json()["replicas"].count(victim) == 1
    # /metrics counts through the restart: nothing goes back to zero with the new process.
    m = scrape(fleet["url"])
    assert (value(m, "kvroute:events_restarts_total", replica=victim) or 0) >= 1
    assert (value(m, "kvroute:events_resets_total", replica=victim) or 0) >= 1
    assert (value(m, "kvroute:replica_routed_total", replica=victim) or 0) >= routed_before
    assert routed_before >= 1


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.0}, {"temperature": 0.9, "seed": 42}],
    ids=["greedy", "seeded"],
)
def test_replica_failure_mid_stream_fails_over_without_a_seam(
    fleet: dict[str, Any], sampling: dict[str, Any]
) -> None:
    """The replica serving a stream dies after its first tokens: the rest comes from the
    other replica, resumed from the tokens already streamed, and the client's text is the
    very text an undisturbed run gives -- no error event, no repeat, no gap."""
    door, url = fleet["door"], fleet["url"] + "/v1/completions"
    wait_for(lambda: len(door.fleet.alive()) == 2, 60, "both replicas routable")
    body = {"model": MODEL, "prompt": "failover drill", "max_tokens": 600, "ignore_eos": True}
    body |= sampling
    reference = httpx.post(url, json=body, headers=AUTH, timeout=60).json()["choices"][0]["text"]
    failovers = door.counters["failovers"]
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=AUTH, timeout=60) as r:
        rid = r.headers[REPLICA_HEADER]
        lines = (x for x in r.iter_lines() if x and not x.startswith(":"))  # not SSE comments
        events = [next(lines), next(lines)]
        ray.get(fleet["actors"][rid].inject_engine_failure.remote())
        events.extend(lines)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks[-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert door.counters["failovers"] == failovers + 1 and rid not in door.fleet.alive()


def test_a_second_failure_mid_stream_ends_the_stream_with_an_error(
    fleet: dict[str, Any],
) -> None:
    """One failover per request: when the replica it moved to fails too, the SSE stream
    says what happened and ends with [DONE] -- it neither hangs nor is cut without a word."""
    door = fleet["door"]
    wait_for(lambda: len(door.fleet.alive()) == 2, 60, "both replicas routable")
    body = {**ENDLESS, "prompt": "mid-stream", "stream": True}
    events = []
    with httpx.stream(
        "POST", fleet["url"] + "/v1/completions", json=body, headers=AUTH, timeout=30
    ) as r:
        lines = (x for x in r.iter_lines() if x and not x.startswith(":"))
        events.append(next(lines))
        ray.get([a.inject_engine_failure.remote() for a in fleet["actors"].values()])
        events.extend(lines)
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))
    assert error["error"]["type"] == "service_unavailable", error
    assert error["error"]["request_id"] == r.headers["x-request-id"]
    wait_for(lambda: not door.fleet.alive(), 5, "both replicas dropped")
