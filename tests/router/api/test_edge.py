"""The front door's edge: strict validation from the engine's own bounds, unsupported OpenAI
parameters refused by name, authentication before the body, error bodies without internals,
request ids, and a body cap that keeps large bodies off the event loop.

Why over real HTTP with a real replica: every case below was, on an earlier main, a 200 that
ignored a field, a 500, a 400 whose text was a Ray traceback, or a replica killed by one
request -- failures that live between the parser, the handlers, Ray and the engine.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvroute.events.replica_api import SEED_MAX, SEED_MIN
from kvroute.replica.serve.actor import start_replica

from ...prom import METRICS_KEY, scrape, value
from ...ray_session import local_ray
from ..served import MODEL, Served, assert_clean_error, serve

CONFIG = {"model": MODEL, "block_size": 16, "num_blocks": 64}
AUTH = {"Authorization": "Bearer key-a", "content-type": "application/json"}
METRICS = {"Authorization": f"Bearer {METRICS_KEY}"}
BODY_CAP = 1 << 20
BODY_TIMEOUT = 1.0  # and the request head's
IDLE_TIMEOUT = 3.0  # a fresh connection that sends nothing (kvroute serve: 75 s, as keep-alive)
C, H = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with local_ray() as started:
        actors = [start_replica("e0", CONFIG, num_cpus=0.5, torch_threads=1)]
        started.extend(actors)
        deadlines = {"head_timeout_s": BODY_TIMEOUT, "idle_timeout_s": IDLE_TIMEOUT}
        with serve(actors, max_body_bytes=BODY_CAP, body_timeout_s=BODY_TIMEOUT, **deadlines) as s:
            yield s


def post(served: Served, path: str, body: Any, headers: dict[str, str] = AUTH) -> httpx.Response:
    """JSON as the SDKs send it (ASCII escapes: a lone surrogate arrives as ``\\ud800``)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(served.url + path, content=content, headers=headers, timeout=60)


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "x", "max_tokens": 1, **kw}


def chat(content: Any = "hi", **kw: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": content}]
    return {"model": MODEL, "max_tokens": 1, "messages": messages, **kw}


BAD: list[tuple[str, str, dict[str, Any], str | None]] = [
    # Once a 400 whose message was a Ray traceback.
    ("empty-stop", C, completion(stop=""), "stop"),
    ("empty-stop-in-list", C, completion(stop=["a", ""]), "stop.1"),
    ("token-past-uint32", C, completion(prompt=[1_000_000_000_000]), "prompt.0"),
    ("token-negative", C, completion(prompt=[-5]), "prompt.0"),
    ("token-past-vocab", C, completion(prompt=[3, 300]), "prompt"),
    # Once 500s.
    ("long-prompt-negative-id", C, completion(prompt=[-1] + [0] * 20), "prompt.0"),
    ("surrogate-prompt", C, completion(prompt="\ud800"), None),
    ("surrogate-chat", H, chat("a \udc00 b"), None),
    ("text-part-not-string", H, chat([{"type": "text", "text": 1}]), "messages.0.content.0.text"),
    ("text-part-no-text", H, chat([{"type": "text"}]), "messages.0.content.0.text"),
    ("surrogate-model", C, completion(model="\ud800"), None),
    # The query of death: past int64, which torch's generator cannot take.
    ("seed-2**70", C, completion(seed=2**70, temperature=0.5), "seed"),
    ("seed-below-int64", C, completion(seed=SEED_MIN - 1, temperature=0.5), "seed"),
    # Strict types, as OpenAI's.
    ("stream-string", C, completion(stream="yes"), "stream"),
    ("max-tokens-string", C, completion(max_tokens="5"), "max_tokens"),
    ("max-tokens-bool", C, completion(max_tokens=True), "max_tokens"),
    # strings are text prompts, ints token ids: a list mixing them is neither
    ("token-ids-strings", C, completion(prompt=["1", 2]), "prompt.0"),
    ("ignore-eos-string", C, completion(ignore_eos="yes"), "ignore_eos"),
    ("presence-penalty-past-2", C, completion(presence_penalty=2.5), "presence_penalty"),
    ("repetition-penalty-zero", C, completion(repetition_penalty=0), "repetition_penalty"),
    ("frequency-penalty-string", C, completion(frequency_penalty="1"), "frequency_penalty"),
    ("logit-bias-word-key", C, completion(logit_bias={"the": 1}), "logit_bias"),
    ("logit-bias-past-vocab", C, completion(logit_bias={"261": 1}), "logit_bias"),
    ("logit-bias-past-100", H, chat(logit_bias={"5": 101}), "logit_bias.5"),
    # A key of the client's own text in the path: once a message of two lines (hypothesis)
    ("logit-bias-key-newline", H, chat(logit_bias={"\x9c\n": {}}), "logit_bias.'\\x9c\\n'"),
    (
        "logit-bias-key-long",
        H,
        chat(logit_bias={"k" * 500: "x"}),
        "logit_bias." + repr("k" * 500)[:40],
    ),
    ("temperature-string", C, completion(temperature="1"), "temperature"),
    ("temperature-range", C, completion(temperature=2.5), "temperature"),
    ("top-p-zero", C, completion(top_p=0), "top_p"),
    ("max-tokens-past-context", C, completion(max_tokens=10**6), "max_tokens"),
    ("no-messages", H, chat() | {"messages": []}, "messages"),
    ("logprobs-past-5", C, completion(logprobs=6), "logprobs"),
    ("logprobs-bool-on-completions", C, completion(logprobs=True), "logprobs"),
    ("top-logprobs-past-20", H, chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("top-logprobs-without-logprobs", H, chat(top_logprobs=2), "top_logprobs"),
    ("bad-role", H, chat() | {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
]


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_invalid_requests_are_clean_400s(
    served: Served, path: str, body: dict[str, Any], param: str | None
) -> None:
    err = assert_clean_error(post(served, path, body), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


UNSUPPORTED: list[tuple[str, dict[str, Any], str]] = [
    # tools' "auto" (their default) needs --enable-auto-tool-choice (tests/router/api/agents/
    # test_tool_calls.py serves them); tools stay refused on the legacy completions
    (H, chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice"),
    (H, chat(tool_choice="auto"), "tool_choice"),
    (C, completion(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (C, completion(prompt_logprobs=1), "prompt_logprobs"),  # vLLM's; echo gives them
    (C, completion(suffix="tail"), "suffix"),
    (H, chat([{"type": "image_url", "image_url": {"url": "http://x"}}]), "messages.0.content.0"),
]


@pytest.mark.parametrize(("path", "body", "param"), UNSUPPORTED, ids=[u[2] for u in UNSUPPORTED])
def test_unsupported_parameters_are_refused_by_name(
    served: Served, path: str, body: dict[str, Any], param: str
) -> None:
    err = assert_clean_error(post(served, path, body), 400)
    assert (err["param"], err["code"]) == (param, "unsupported_parameter")
    assert param.split(".")[0] in err["message"] or "Content parts" in err["message"]


def test_neutral_values_and_bounds_are_served(served: Served) -> None:
    """What asks for nothing unsupported is accepted; the bounds' own edges sample."""
    neutral = completion(n=1, tools=[], echo=False, logprobs=None, temperature=1, top_p=1)
    assert post(served, C, neutral).status_code == 200
    ok = post(served, H, chat(logprobs=False, tool_choice="none", top_logprobs=0))
    assert ok.status_code == 200, ok.text
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="key-a", max_retries=0)
    for seed in (SEED_MIN, SEED_MAX):
        out = client.completions.create(
            model=MODEL, prompt="seeded", max_tokens=3, temperature=0.9, seed=seed
        )
        assert out.choices[0].finish_reason in ("length", "stop")
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    assert post(served, H, chat(parts)).status_code == 200
    assert post(served, C, completion(prompt=[1, 2, 260])).status_code == 200  # vocab's last
    edges = {"presence_penalty": -2, "frequency_penalty": 2.0, "repetition_penalty": 10}
    assert post(served, C, completion(**edges)).status_code == 200
    assert post(served, H, chat(presence_penalty=2, repetition_penalty=0.01)).status_code == 200
    # No model named: the served one, as vLLM answers (OpenAI requires the field).
    r = post(served, C, {"prompt": "x", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == MODEL, r.text
    forced = completion(logit_bias={"65": 100}, max_tokens=4, temperature=0)
    r = post(served, C, forced)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "AAAA", r.text


def test_authentication_comes_before_the_body(served: Served) -> None:
    headers = {"content-type": "application/json"}
    for body in (b"{not json", b"", b"[]", json.dumps({"model": 5}).encode()):
        assert_clean_error(post(served, C, body, headers), 401)
        assert_clean_error(post(served, C, body, {**headers, "Authorization": "Bearer no"}), 401)
        assert_clean_error(post(served, C, body), 400)  # with a key: now the body counts
    # A body past the cap, without a key: 401 all the same, before it is read.
    big = b"x" * (2 * BODY_CAP)
    assert_clean_error(post(served, C, big, headers), 401)


def test_every_response_carries_a_request_id(served: Served) -> None:
    ids = [
        httpx.get(served.url + "/health").headers["x-request-id"],
        httpx.get(served.url + "/metrics", headers=METRICS).headers["x-request-id"],
        httpx.get(served.url + "/v1/models", headers=AUTH).headers["x-request-id"],
        httpx.get(served.url + "/v1/nope", headers=AUTH).headers["x-request-id"],
        post(served, C, completion()).headers["x-request-id"],
    ]
    with httpx.stream(
        "POST", served.url + C, content=json.dumps(completion(stream=True)), headers=AUTH
    ) as r:
        ids.append(r.headers["x-request-id"])
        assert r.read().decode().rstrip().endswith("data: [DONE]")
    assert all(re.fullmatch(r"req-[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == len(ids)


@contextlib.contextmanager
def health_latencies(served: Served) -> Iterator[list[float]]:
    """/health's latencies, polled from a thread of their own while the block runs."""
    out: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client() as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                assert c.get(served.url + "/health").status_code == 200
                out.append(time.perf_counter() - t0)
                time.sleep(0.01)

    probe = threading.Thread(target=poll)
    probe.start()
    try:
        yield out
    finally:
        stop.set()
        probe.join()


def test_large_bodies_never_stall_the_event_loop(served: Served) -> None:
    """A 10 MB body is refused (413) before it is read; one under the cap is parsed off the
    loop and refused by a cheap length bound before any tokenization. Meanwhile /health
    answers as fast as it does idle (within 100 ms of its idle worst case)."""
    with health_latencies(served) as idle:
        time.sleep(1.0)  # a window of idle samples to compare with: the measurement itself

    with health_latencies(served) as busy:
        t0 = time.perf_counter()
        huge = json.dumps(completion(prompt="x" * (10 << 20))).encode()
        err = assert_clean_error(post(served, C, huge), 413)
        assert err["code"] == "body_too_large"

        def chunks() -> Iterator[bytes]:  # no content-length: counted as it arrives
            yield huge[: 1 << 20]
            yield huge[1 << 20 :]

        chunked = httpx.post(served.url + C, content=chunks(), headers=AUTH, timeout=60)
        assert_clean_error(chunked, 413)
        near_cap = json.dumps(completion(prompt="y" * (BODY_CAP - 1000))).encode()
        err = assert_clean_error(post(served, C, near_cap), 400)
        assert err["code"] == "context_length_exceeded"
        many = [{"role": "user", "content": "z" * 100_000}] * 9
        err = assert_clean_error(post(served, H, chat() | {"messages": many}), 400)
        assert err["code"] == "context_length_exceeded"
        elapsed = time.perf_counter() - t0
        time.sleep(0.3)  # samples just after the bodies too: the window is the measurement
    assert elapsed < 10, elapsed
    assert len(busy) >= 10
    assert max(busy) < max(idle) + 0.1, (max(busy), max(idle))


def test_a_slow_body_times_out_and_frees_its_handler(served: Served) -> None:
    """A client that declares a body and sends it too slowly gets a 408, not a handler
    (and its buffers) held for as long as it likes; meanwhile others are served."""
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-a\r\n"
            b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"model":'
        )
        t0 = time.perf_counter()
        assert post(served, C, completion()).status_code == 200  # not held up meanwhile
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            assert data, reply
            reply += data
        waited = time.perf_counter() - t0
    head, _, payload = reply.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 408"), head
    error = json.loads(payload)["error"]
    assert error["code"] == "body_timeout" and error["request_id"] in head
    assert BODY_TIMEOUT * 0.5 < waited < BODY_TIMEOUT + 5


def test_slow_heads_and_idle_connections_are_closed_and_crowd_out_no_one(
    served: Served,
) -> None:
    """Slowloris: 150 connections send one header line of a request and then nothing, 100
    more connect and send nothing. Meanwhile requests are served and /health answers
    within 100 ms of its idle worst case; the server closes every slow head once its
    deadline (from the head's first byte) passes, and every idle one after the idle
    timeout, so none holds a socket for as long as its client likes."""
    host, port = served.url.removeprefix("http://").split(":")
    with health_latencies(served) as idle:
        time.sleep(1.0)  # a window of idle samples to compare with: the measurement itself

    slow = [socket.create_connection((host, int(port)), timeout=10) for _ in range(150)]
    quiet = [socket.create_connection((host, int(port)), timeout=10) for _ in range(100)]
    t0 = time.perf_counter()
    for sock in slow:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")

    def closed_at(sock: socket.socket) -> float:
        """Seconds from t0 until the server closed ``sock`` (recv returns b"")."""
        while sock.recv(4096):
            pass
        return time.perf_counter() - t0

    try:
        with health_latencies(served) as busy:  # while the slow connections are held
            for _ in range(3):
                assert post(served, C, completion()).status_code == 200
            slow_closed = [closed_at(s) for s in slow]
            quiet_closed = [closed_at(s) for s in quiet]
    finally:
        for sock in slow + quiet:
            sock.close()
    assert served.server is not None  # which protocol kept them out: httptools where installed
    print(
        f"\n{served.server.config.http_protocol_class.__name__}: "
        f"slow clients: {len(slow)} slow heads closed {min(slow_closed):.2f}-"
        f"{max(slow_closed):.2f} s after their first byte (deadline {BODY_TIMEOUT} s), "
        f"{len(quiet)} idle ones {min(quiet_closed):.2f}-{max(quiet_closed):.2f} s after "
        f"connecting (deadline {IDLE_TIMEOUT} s); /health max {max(busy) * 1000:.1f} ms "
        f"meanwhile ({max(idle) * 1000:.1f} ms idle)"
    )
    assert len(busy) >= 10 and max(busy) < max(idle) + 0.1, (max(busy), max(idle))
    assert min(slow_closed) > BODY_TIMEOUT * 0.5 and max(slow_closed) < BODY_TIMEOUT + 5
    assert min(quiet_closed) > IDLE_TIMEOUT * 0.5 and max(quiet_closed) < IDLE_TIMEOUT + 5
    assert post(served, C, completion()).status_code == 200


def test_metrics_count_failovers_and_quarantine(served: Served) -> None:
    m = scrape(served.url)
    assert value(m, "kvroute:failovers_total") == 0
    assert value(m, "kvroute:quarantined_requests") == 0


def test_logprobs_are_returned_in_openais_shapes(served: Served) -> None:
    """Greedy: the chosen token is the likeliest of its alternatives, every logprob <= 0,
    one entry per generated token, streamed or not."""
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="key-a", max_retries=0)
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 0.0}
    kw["extra_body"] = {"ignore_eos": True}
    out = client.completions.create(prompt="logprobs", logprobs=3, **kw)
    lp = out.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # Byte tokens may share a name (U+FFFD): the legacy dict then holds fewer than 3.
        assert 1 <= len(top) <= 3 and logprob <= 0 and max(top.values()) == logprob
        assert top[token] == logprob
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = [
        t
        for chunk in client.completions.create(prompt="logprobs", logprobs=3, stream=True, **kw)
        for t in (chunk.choices[0].logprobs.token_logprobs if chunk.choices[0].logprobs else [])
    ]
    assert streamed == lp.token_logprobs
    msg = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(messages=msg, logprobs=True, top_logprobs=2, **kw)
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert entry.top_logprobs[0].logprob == entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode("utf-8", "replace"))
    plain = client.chat.completions.create(messages=msg, **kw)
    assert plain.choices[0].logprobs is None
