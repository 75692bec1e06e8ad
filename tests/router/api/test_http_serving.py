"""The HTTP front door end to end, with real parts: a local Ray, two replica actors of the
tiny model, the FastAPI app under uvicorn, and the official ``openai`` client.

Why real parts: what breaks a front door lives between them -- SSE framing as the SDK parses
it, the salt the router hashes with against the one the engine caches with, a stream whose
client left, a replica that dies before its first token.

Here: serving (models, completions, chat, batches, prefix hits, errors) and what /metrics
and the Grafana dashboard show after it. The fleet is conftest.py's; tenants are in
test_http_tenants.py, disconnects, overload and replica failures in test_http_failures.py.
"""

from __future__ import annotations

import gc
import json
from typing import Any

import httpx
import openai
import pytest

from kvroute.router.api.app import REPLICA_HEADER

from ...deploy.test_grafana import load as load_dashboard
from ...deploy.test_grafana import queried_series
from ...prom import scrape, value
from ...waiting import wait_for
from .http_fleet import AUTH, CONFIG, LONG, MODEL, client, running


def test_the_started_front_door_keeps_its_startup_heap_out_of_the_collectors_walk(
    fleet: dict[str, Any],
) -> None:
    """What lived when the server started (its app, front door, fleet and every module's
    objects) is frozen: a full collection, which stops every stream, no longer walks it."""
    walked = {id(o) for o in gc.get_objects()}
    door = fleet["door"]
    for obj in (fleet["app"], door, door.fleet, door.fleet.index, door.metrics):
        assert id(obj) not in walked, type(obj).__name__
    assert gc.get_freeze_count() > 0


# -- serving ---------------------------------------------------------------------------------
def test_health_models_and_unknown_routes(fleet: dict[str, Any]) -> None:
    url = fleet["url"]
    h = httpx.get(url + "/health")
    assert h.status_code == 200 and sorted(h.json()["replicas"]) == ["r0", "r1"]
    models = client(fleet).models.list()
    assert [m.id for m in models.data] == [MODEL]
    r = httpx.get(url + "/v1/nope", headers={"Authorization": "Bearer key-a"})
    assert r.status_code == 404 and "message" in r.json()["error"]


def test_completion_stream_equals_non_stream(fleet: dict[str, Any]) -> None:
    c = client(fleet)
    kw: dict[str, Any] = {"model": MODEL, "prompt": "Hello there", "max_tokens": 12}
    kw.update(temperature=0.0, extra_body={"ignore_eos": True})
    full = c.completions.with_raw_response.create(**kw)
    assert full.headers[REPLICA_HEADER] in ("r0", "r1")
    body = full.parse()
    assert body.choices[0].finish_reason == "length"
    assert body.usage.completion_tokens == 12
    assert body.usage.prompt_tokens == len("Hello there")
    pieces, finishes = [], []
    for chunk in c.completions.create(**kw, stream=True):
        pieces.append(chunk.choices[0].text)
        finishes.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == body.choices[0].text
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])


def test_a_prompt_list_of_one_is_that_prompt(fleet: dict[str, Any]) -> None:
    """Clients that batch (LangChain's completions LLM) send even one prompt as a list."""
    c = client(fleet)
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 0.0}
    kw["extra_body"] = {"ignore_eos": True}
    ids = list(b"Hello there")  # the tiny tokenizer's ids are the bytes
    plain = c.completions.create(prompt="Hello there", **kw).choices[0].text
    for prompt in (["Hello there"], [ids], ids):
        got = c.completions.create(prompt=prompt, **kw)
        assert len(got.choices) == 1 and got.choices[0].text == plain, prompt
        assert got.usage.prompt_tokens == len(ids)
    url, auth = fleet["url"] + "/v1/completions", {"Authorization": "Bearer key-a"}
    for prompt in ([], ["a", 1], [[]], [[1], "a"]):
        r = httpx.post(url, json={"model": MODEL, "prompt": prompt}, headers=auth)
        assert r.status_code == 400, (prompt, r.text)
        assert r.json()["error"]["param"].startswith("prompt"), r.text


def test_a_batch_and_n_are_choices_in_order(fleet: dict[str, Any]) -> None:
    """Each prompt of a batch gets ``n`` choices, indexed prompt by prompt; usage counts each
    prompt once; every run ends (nothing left on the replicas)."""
    c = client(fleet)
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 5, "temperature": 0.0}
    kw["extra_body"] = {"ignore_eos": True}
    prompts = ["Hello there", "General Kenobi, you are a bold one"]
    single = [c.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    got = c.completions.create(prompt=prompts, n=2, **kw)
    assert [ch.index for ch in got.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in got.choices] == [single[0]] * 2 + [single[1]] * 2
    assert all(ch.finish_reason == "length" for ch in got.choices)
    assert got.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert got.usage.completion_tokens == 4 * 5
    # Sampled: n seeded choices differ from each other, and the request is reproducible.
    sampled = {"model": MODEL, "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3}
    a = c.completions.create(prompt="Hello there", **sampled, extra_body={"ignore_eos": True})
    b = c.completions.create(prompt="Hello there", **sampled, extra_body={"ignore_eos": True})
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert len({ch.text for ch in a.choices}) == 3
    chat = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2,
        temperature=0.0,
    )  # fmt: skip
    assert [ch.index for ch in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content
    url, auth = fleet["url"] + "/v1/completions", {"Authorization": "Bearer key-a"}
    for extra, param in (
        ({"best_of": 3, "stream": True}, "best_of"),  # several choices stream; best_of not
        ({"best_of": 65}, "best_of"),
        ({"n": 65}, "n"),
        ({"prompt": ["a"] * 33, "n": 2}, "n"),
    ):
        r = httpx.post(url, json={"model": MODEL, "prompt": "x", **extra}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    wait_for(lambda: running(fleet) == 0, 30, "every choice's run ended")


def test_chat_stream_and_non_stream(fleet: dict[str, Any]) -> None:
    c = client(fleet)
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 10, "temperature": 0.0}
    kw.update(messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True})
    full = c.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 10 and full.usage.prompt_tokens > len("hi")
    chunks = list(
        c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_shared_prefix_goes_to_the_same_replica_and_hits(fleet: dict[str, Any]) -> None:
    c = client(fleet)
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "temperature": 0.0}
    first = c.completions.with_raw_response.create(prompt=LONG + "first question?", **kw)
    second = c.completions.with_raw_response.create(prompt=LONG + "second one!", **kw)
    assert second.headers[REPLICA_HEADER] == first.headers[REPLICA_HEADER]
    assert first.parse().usage.prompt_tokens_details.cached_tokens == 0
    cached = second.parse().usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 * (len(LONG) // 16) - 16 and cached > 200
    # Another tenant, same prompt, on the very replica that holds alpha's blocks (the other
    # one cordoned): its salt differs, so nothing of alpha's can be hit.
    door, served = fleet["door"], first.headers[REPLICA_HEADER]
    door.fleet.cordon("r1" if served == "r0" else "r0")
    try:
        other = client(fleet, "key-b").completions.with_raw_response.create(
            prompt=LONG + "second one!", **kw
        )
        # The same tenant with its own extra salt is isolated from its unsalted blocks too.
        salted = c.completions.with_raw_response.create(
            prompt=LONG + "second one!", extra_body={"cache_salt": "x"}, **kw
        )
        again = c.completions.create(prompt=LONG + "second one!", **kw)
    finally:
        door.fleet.cordon("r1" if served == "r0" else "r0", False)
    assert other.headers[REPLICA_HEADER] == salted.headers[REPLICA_HEADER] == served
    assert other.parse().usage.prompt_tokens_details.cached_tokens == 0
    assert salted.parse().usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 200  # still there, for alpha
    # The index learned alpha's blocks from the events of the replica that served them.
    wait_for(lambda: door.fleet.index.num_blocks(served) >= 18, 10, "events")


def test_errors_are_openai_style(fleet: dict[str, Any]) -> None:
    url = fleet["url"] + "/v1/completions"
    auth = {"Authorization": "Bearer key-a"}
    with pytest.raises(openai.AuthenticationError):
        client(fleet, "wrong").completions.create(model=MODEL, prompt="x")
    r = httpx.post(url, json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    cases = [
        (b"{not json", None),
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 10**6}, "max_tokens"),
        ({"model": "gpt-9", "prompt": "x"}, "model"),  # a 404, as vLLM answers
        ({"model": MODEL, "prompt": ""}, "prompt"),
    ]
    for body, param in cases:
        if isinstance(body, bytes):
            r = httpx.post(url, content=body, headers={**auth, "content-type": "application/json"})
        else:
            r = httpx.post(url, json=body, headers=auth)
        assert r.status_code == (404 if param == "model" else 400), (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code", "request_id"} and err["message"]
        assert err["request_id"] == r.headers["x-request-id"]
        if param:
            assert err["param"] == param, (body, err)
    with pytest.raises(openai.BadRequestError):
        client(fleet).chat.completions.create(model=MODEL, messages=[])


def test_a_stream_says_what_the_front_door_added(fleet: dict[str, Any]) -> None:
    """The SSE comment before [DONE] gives the replica's TTFT and the front door's; the
    official client ignores it (test_completion_stream_equals_non_stream streams the same)."""
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 4, "stream": True}
    url = fleet["url"] + "/v1/completions"
    with httpx.stream("POST", url, json=body, headers=AUTH, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    timing = [json.loads(x.split(" ", 2)[2]) for x in lines if x.startswith(": kvroute-timing ")]
    assert len(timing) == 1 and lines[-1] == "data: [DONE]"
    t = timing[0]
    assert 0 < t["replica_ttft_s"] < t["router_ttft_s"] < 60
    samples = scrape(fleet["url"])
    assert value(samples, "kvroute:router_added_latency_recent_seconds", quantile="0.99")
    assert (value(samples, "kvroute:router_added_latency_seconds_count") or 0) >= 1


def test_metrics(fleet: dict[str, Any]) -> None:
    wait_for(lambda: fleet["door"].fleet.load.in_flight() == 0, 10, "earlier streams closed")
    m = scrape(fleet["url"])

    def v(name: str, **labels: str) -> float:
        got = value(m, "kvroute:" + name, **labels)
        assert got is not None, (name, labels)
        return got

    assert v("requests_routed_total") >= 5
    assert v("prefix_cache_hits_total") > 200
    assert v("prefix_cache_queries_total") > v("prefix_cache_hits_total")
    assert v("prompt_tokens_total", tenant="alpha") == v(
        "prefix_cache_queries_total", tenant="alpha"
    )
    assert v("errors_total", kind="auth") >= 1
    assert v("http_requests_total", tenant="none", code="401") >= 1  # no tenant: bad key
    assert v("http_requests_total", tenant="alpha", code="200") >= 5
    assert v("routing_decisions_total", reason="cache_hit") >= 1  # LONG, sent again and again
    assert v("routing_decisions_total") >= 5
    finished = v("request_success_total", tenant="alpha")
    assert v("time_to_first_token_seconds_count", tenant="alpha") == finished >= 5
    assert v("e2e_request_latency_seconds_count", tenant="alpha") == finished
    assert v("inter_token_latency_seconds_count", tenant="alpha") >= 1
    routed = [v("replica_routed_total", replica=f"r{i}") for i in (0, 1)]
    assert sum(routed) >= 5
    assert v("index_blocks", replica="r0") >= 0
    delivered = [v("events_delivered_total", replica=f"r{i}") for i in (0, 1)]
    assert min(delivered) >= 1  # at least the snapshot each replica answered on joining
    for i in (0, 1):  # KV blocks and queues per replica, from its own load reports
        total = v("kv_cache_blocks_total", replica=f"r{i}")
        free = v("kv_cache_blocks_free", replica=f"r{i}")
        assert total == CONFIG["num_blocks"] and 0 <= free <= total
        assert 0 <= v("kv_cache_usage_perc", replica=f"r{i}") <= 1
        assert v("num_requests_waiting", replica=f"r{i}") >= 0
        assert v("replica_num_requests_in_flight", replica=f"r{i}") == 0
    assert v("num_requests_in_flight") == 0  # nothing is running now


def test_the_grafana_dashboard_queries_only_exported_series(fleet: dict[str, Any]) -> None:
    """Every series deploy/grafana/kvroute.json queries is one this front door exports,
    with samples, once requests have run (earlier tests sent them)."""
    exported = {s.name for s in scrape(fleet["url"])}
    missing = queried_series(load_dashboard()) - exported
    assert not missing, sorted(missing)
