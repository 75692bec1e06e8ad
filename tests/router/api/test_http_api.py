"""The HTTP front door end to end, with real parts: a local Ray, two replica actors of the
tiny model, the FastAPI app under uvicorn, and the official ``openai`` client.

Why real parts: what breaks a front door lives between them -- SSE framing as the SDK parses
it, the salt the router hashes with against the one the engine caches with, a stream whose
client left, a replica that dies before its first token.
"""

from __future__ import annotations

import contextlib
import gc
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import openai
import pytest
import ray
import uvicorn

from kvroute.deploy.http_server import uvicorn_config
from kvroute.events.replica_api import ReplicaInfo
from kvroute.replica.serve.actor import start_replica
from kvroute.router.api.app import REPLICA_HEADER, create_app
from kvroute.router.fleet.tenants import (
    AuthError,
    TenantConfig,
    Tenants,
    TenantsFile,
    hash_key,
    load_api_keys,
    tenant_salt,
    tenants_from_api_keys,
)
from kvroute.router.frontdoor import FleetMismatchError, FrontDoor

from ...deploy.test_grafana import load as load_dashboard
from ...deploy.test_grafana import queried_series
from ...prom import METRICS_KEY, scrape, value
from ...ray_session import local_ray
from ...waiting import wait_for
from ..served import assert_clean_error

MODEL = "tiny"
CONFIG = {"model": MODEL, "block_size": 16, "num_blocks": 160}  # 2,560 tokens a replica
KEYS = {"key-a": "alpha", "key-b": "beta"}
# ~300 bytes = ~300 tokens of the byte-level tiny tokenizer: 18 full blocks to share.
LONG = "The quick brown fox jumps over the lazy dog while the router watches. " * 4


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, Any]]:
    with local_ray() as started:
        actors = [
            start_replica(f"r{i}", CONFIG, num_cpus=0.5, torch_threads=1, max_restarts=-1)
            for i in range(2)
        ]
        started.extend(actors)
        infos = ray.get([a.info.remote() for a in actors], timeout=120)
        door = FrontDoor(list(zip(actors, infos, strict=True)), monitor_interval_s=0.5)
        app = create_app(door, Tenants(tenants_from_api_keys(KEYS), "test-secret", METRICS_KEY))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        wait_for(lambda: server.started, 30, "uvicorn started")
        url = f"http://127.0.0.1:{port}"
        actors_by_id = dict(zip(("r0", "r1"), actors, strict=True))
        yield {"url": url, "door": door, "actors": actors_by_id, "app": app}
        server.should_exit = True
        thread.join(10)


def client(fleet: dict[str, Any], key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet["url"] + "/v1", api_key=key, max_retries=0, timeout=60)


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


# -- tenants (no server) --------------------------------------------------------------------
def test_tenants_salt_isolates_and_request_salt_only_narrows(tmp_path: Any) -> None:
    t = Tenants(tenants_from_api_keys(KEYS), "s")
    a, b = t.authenticate("Bearer key-a"), t.authenticate("bearer key-b")
    assert (a.tenant_id, b.tenant_id) == ("alpha", "beta")
    assert a.cache_salt == tenant_salt("s", "alpha") != b.cache_salt
    assert (
        Tenants(tenants_from_api_keys(KEYS), "other").authenticate("Bearer key-a").cache_salt
        != a.cache_salt
    )
    # A request's own salt is appended: it can never equal another tenant's salt.
    assert a.salt_for("x") == a.cache_salt + ":x" and a.salt_for(None) == a.cache_salt
    for bad in (None, "", "Bearer", "Bearer nope", "Basic key-a"):
        with pytest.raises(AuthError):
            t.authenticate(bad)
    assert Tenants(None, "s").authenticate(None).tenant_id == "default"
    (tmp_path / "k.txt").write_text("# keys\nk1:t1\n\nk2 : t2\n")
    (tmp_path / "k.json").write_text('{"k1": "t1"}')
    assert load_api_keys(tmp_path / "k.txt") == {"k1": "t1", "k2": "t2"}
    assert load_api_keys(tmp_path / "k.json") == {"k1": "t1"}
    (tmp_path / "bad.txt").write_text("no-colon\n")
    with pytest.raises(ValueError, match=r"bad\.txt:1"):
        load_api_keys(tmp_path / "bad.txt")


def test_front_door_refuses_a_replica_that_hashes_or_serves_differently() -> None:
    base = ReplicaInfo(
        replica_id="a", model=MODEL, model_path="/nonexistent", hash_algo="xxh3_128",
        hash_seed="s", hash_form="bytes", block_size=16, num_blocks=8, max_model_len=128,
        data_endpoint="tcp://127.0.0.1:8", events_endpoint="tcp://127.0.0.1:9",
        replay_endpoint=None, topic="a",
        node_ip="127.0.0.1", pid=1, incarnation="x", restarted=False,
    )  # fmt: skip
    door = FrontDoor([(None, base)], tokenizer=object())
    try:
        for change, why in (
            ({"hash_seed": "other"}, "seed"),
            ({"block_size": 32}, "block_size"),
            ({"hash_algo": "sha256_cbor"}, "algo"),
            ({"hash_form": "int"}, "hash form"),
            ({"model": "smollm2-135m"}, "model"),
        ):
            bad = msgspec.structs.replace(base, replica_id="b", **change)
            with pytest.raises(FleetMismatchError, match=why):
                door.fleet.add(None, bad)
        assert list(door.fleet.replicas) == ["a"]
        door.fleet.add(None, msgspec.structs.replace(base, replica_id="b"))
        assert door.fleet.alive() == ["a", "b"]
    finally:
        door.fleet.subscriber.close()


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


def running(fleet: dict[str, Any]) -> int:
    stats = ray.get([a.stats.remote() for a in fleet["actors"].values()])
    return sum(s["num_running"] + s["num_waiting"] for s in stats)


# ~8 s of decoding on an idle core (tiny: ~3 ms a token): far longer than the waits below.
ENDLESS = {"model": MODEL, "max_tokens": 2500, "temperature": 0.0, "ignore_eos": True}
AUTH = {"Authorization": "Bearer key-a"}


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


def test_tenants_file_limits_and_the_admin_view(fleet: dict[str, Any]) -> None:
    """A tenants file's limits over real HTTP: a tenant past its requests per minute, then
    one past its tokens per minute (its output charged when it ended), get 429 with the
    seconds to wait, while another tenant is served; /fleet is for admin keys alone."""
    app, url, door = fleet["app"], fleet["url"], fleet["door"]
    spec = TenantsFile(
        [
            TenantConfig("alpha", [hash_key("key-a")]),
            TenantConfig("gamma", [hash_key("key-g")], requests_per_minute=2),
            TenantConfig("delta", [hash_key("key-d")], tokens_per_minute=60),
            TenantConfig("kappa", [hash_key("key-k")], max_concurrent=2),
        ],
        admin_keys=[hash_key("key-admin")],
    )
    old, app.state.tenants = app.state.tenants, Tenants(spec, "test-secret")

    def post(key: str, **body: Any) -> httpx.Response:
        body = {"model": MODEL, "prompt": "limits", "max_tokens": 1, **body}
        auth = {"Authorization": f"Bearer {key}"}
        return httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=60)

    try:
        assert [post("key-g").status_code for _ in range(2)] == [200, 200]
        refused = post("key-g")
        err = assert_clean_error(refused, 429)
        assert "2 requests per minute" in err["message"]
        assert 25 <= int(refused.headers["retry-after"]) <= 31  # a request's worth: 30 s
        # 10 prompt tokens + 80 generated: admitted with 60 left, then 30 tokens in debt.
        first = post("key-d", prompt="0123456789", max_tokens=80, ignore_eos=True)
        assert first.json()["usage"]["completion_tokens"] == 80
        refused = post("key-d")
        assert "60 tokens per minute" in assert_clean_error(refused, 429)["message"]
        assert 20 <= int(refused.headers["retry-after"]) <= 35  # ~31 tokens at 1 a second
        assert post("key-a").status_code == 200  # the others are served meanwhile
        # More choices than the tenant may ever run at once: a 400, not a 429 to retry.
        err = assert_clean_error(post("key-k", n=3), 400)
        assert err["param"] == "n" and "at most 2 at once" in err["message"]
        assert len(post("key-k", n=2).json()["choices"]) == 2
        admission = door.admission
        assert admission.tenant_in_flight("gamma") == admission.tenant_in_flight("delta") == 0

        assert assert_clean_error(httpx.get(url + "/fleet"), 401)["code"] == "invalid_api_key"
        tenant_key = {"Authorization": "Bearer key-a"}
        assert assert_clean_error(httpx.get(url + "/fleet", headers=tenant_key), 403)
        admin = {"Authorization": "Bearer key-admin"}
        assert assert_clean_error(post("key-admin"), 401)  # an admin key is not a tenant
        view = httpx.get(url + "/fleet", headers=admin, timeout=10).json()
        assert view["policy"] == "kv" and view["hash"]["block_size"] == CONFIG["block_size"]
        assert [r["replica_id"] for r in view["replicas"]] == ["r0", "r1"]
        for rep in view["replicas"]:
            rid = rep["replica_id"]
            assert rep["healthy"] and rep["pid"] > 0 and rep["node_id"]
            assert rep["hash"] == view["hash"]  # the fleet hashes as one
            assert rep["kv_blocks_total"] == CONFIG["num_blocks"]
            assert rep["load"]["total_blocks"] == CONFIG["num_blocks"]
            assert rep["cached_blocks_indexed"] == door.fleet.index.num_blocks(rid)
            assert rep["events"]["last_seq"] >= 0 and rep["events"]["gaps"] >= 0
    finally:
        app.state.tenants = old


def test_admission_comes_before_the_body(fleet: dict[str, Any]) -> None:
    """A tenant at its concurrency limit is refused on its headers alone: a request whose
    body never arrives gets its 429 at once, not a 408 after the body deadline (a refused
    request of a flood costs no body read, no validation, no tokenization)."""
    app, url, door = fleet["app"], fleet["url"], fleet["door"]
    spec = TenantsFile([TenantConfig("eps", [hash_key("key-e")], max_concurrent=1)])
    old, app.state.tenants = app.state.tenants, Tenants(spec, "test-secret")
    auth = {"Authorization": "Bearer key-e"}
    try:
        body = {**ENDLESS, "prompt": "hold", "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=auth) as held:
            lines = held.iter_lines()
            assert next(lines).startswith("data: ")  # its one slot is taken
            host, port = url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Authorization: Bearer key-e\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n"  # and no body, ever
                )
                head = sock.recv(65536)
            assert head.startswith(b"HTTP/1.1 429"), head[:200]
            assert b"retry-after" in head.lower()
            assert door.admission.tenant_in_flight("eps") == 1
        wait_for(lambda: door.admission.tenant_in_flight("eps") == 0, 10, "slot released")
    finally:
        app.state.tenants = old


def test_fleet_view_needs_an_admin_key_beyond_loopback(fleet: dict[str, Any]) -> None:
    """Without keys, /fleet (pids, node addresses) answers only a loopback-only server."""
    app, url = fleet["app"], fleet["url"]
    old = app.state.tenants
    app.state.tenants = Tenants(None, "test-secret")  # no keys: anyone is the default tenant
    try:
        assert httpx.get(url + "/fleet", timeout=10).status_code == 200
        app.state.public = True  # as kvroute serve --host 0.0.0.0 --allow-anonymous sets it
        err = assert_clean_error(httpx.get(url + "/fleet", timeout=10), 403)
        assert err["code"] == "not_admin" and "admin_keys" in err["message"]
    finally:
        app.state.tenants, app.state.public = old, False


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
