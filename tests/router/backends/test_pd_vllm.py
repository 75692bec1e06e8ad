"""``kvroute router --prefill URL --decode URL``: P/D over vLLM's ``kv_transfer_params``,
through a real ``kvroute router`` process and real HTTP, against stand-in backends
(:mod:`.vllm_standin`: the kv_transfer_params side of vLLM's OpenAI server; a real
``vllm serve`` pair is ``test_pd_vllm_real.py``, minutes to start here).

What it proves: a request's prefill half goes to the prefill backend as vLLM's proxies send
it (``kv_transfer_params`` with ``do_remote_decode``, ``max_tokens`` 1, no stream); the
params it answers go, unchanged, with the decode request, whose backend pulls the KV and
whose stream is the client's (token by token, the text a whole run gives); the official
``openai`` client works, completions and chat, streamed or not; a prefill backend that
fails (HTTP 500, no params, unreachable) costs the request nothing: it runs whole on the
decode backend; a prefill backend's 400 is the client's, OpenAI-style.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from kvroute.events.kv_transfer import vllm_prefill_params
from kvroute.router.backends.pd import prefill_body

from ...serve_process import free_port
from .vllm_standin import StandIn, generate, text_of


@dataclass
class Pair:
    url: str
    prefill: StandIn
    decode: StandIn
    router: subprocess.Popen[str]
    log: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    with router_over("always") as served:
        yield served


@contextlib.contextmanager
def router_over(split: str) -> Iterator[Pair]:
    """Two stand-ins (prefill, decode) and a ``kvroute router`` before them."""
    prefill = StandIn("prefill").start()
    decode = StandIn("decode").start()
    port = free_port()
    cmd = [
        sys.executable, "-m", "kvroute.deploy.cli", "router", "--port", str(port),
        "--prefill", prefill.url, "--decode", decode.url, "--pd-split", split,
        "--backend-wait", "30",
    ]  # fmt: skip
    router = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    assert router.stderr is not None
    lines: list[str] = []
    try:
        for line in router.stderr:
            lines.append(line)
            if "ready on" in line:
                break
        else:
            raise AssertionError(f"kvroute router exited {router.wait()}:\n{''.join(lines)}")
        assert "P/D: 1 prefill + 1 decode" in lines[-1], lines[-1]
        served = Pair(f"http://127.0.0.1:{port}", prefill, decode, router, lines)
        stderr = router.stderr
        threading.Thread(target=lambda: served.log.extend(stderr), daemon=True).start()
        yield served
    finally:
        if router.poll() is None:
            router.terminate()
            router.wait(30)
        prefill.stop()
        decode.stop()


def fresh(pair: Pair) -> None:
    pair.prefill.requests.clear()
    pair.decode.requests.clear()
    pair.prefill.fail = None


def sse(pair: Pair, body: dict[str, Any]) -> tuple[str, list[str], httpx.Headers]:
    """A streamed completion: (its text, its data lines, the response headers)."""
    data: list[str] = []
    with httpx.stream("POST", f"{pair.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                data.append(line)
        headers = r.headers
    text = "".join(c["text"] for d in data for c in json.loads(d[6:])["choices"])
    return text, data, headers


def test_prefill_body_is_what_vllms_proxies_send() -> None:
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 9, "stream": True, "min_tokens": 3,
            "stream_options": {"include_usage": True}, "temperature": 0.5}  # fmt: skip
    out = prefill_body(body)
    assert out["kv_transfer_params"] == vllm_prefill_params()
    assert out["kv_transfer_params"]["do_remote_decode"] is True
    assert out["kv_transfer_params"]["do_remote_prefill"] is False
    assert (out["max_tokens"], out["stream"], out["temperature"]) == (1, False, 0.5)
    assert "stream_options" not in out and "min_tokens" not in out
    assert body["max_tokens"] == 9  # the decode request's body is untouched


def test_params_flow_from_the_prefill_answer_to_the_decode_request(pair: Pair) -> None:
    fresh(pair)
    body = {"model": "tiny", "prompt": "kvroute pairs " * 8, "max_tokens": 12, "stream": True,
            "temperature": 0}  # fmt: skip
    text, data, headers = sse(pair, body)
    [p] = pair.prefill.requests
    [d] = pair.decode.requests
    assert p["kv_transfer_params"] == vllm_prefill_params()
    assert (p["max_tokens"], p["stream"]) == (1, False)
    assert p["prompt"] == d["prompt"]  # the same tokens on both halves
    got = d["kv_transfer_params"]  # what the prefill answered, unchanged
    assert got["do_remote_prefill"] is True and got["do_remote_decode"] is False
    assert got["remote_engine_id"] == pair.prefill.engine_id
    assert (got["remote_host"], got["remote_port"]) == ("127.0.0.1", pair.prefill.port)
    assert got["remote_request_id"] in pair.decode.pulls  # the decode side pulled the KV
    assert not pair.prefill.held  # and the prefill side let it go
    assert got["remote_block_ids"] == [list(range(1, -(-len(d["prompt"]) // 32) + 1))]
    # the decode backend's output is the client's: whole, in order, streamed
    assert d["max_tokens"] == 12 and d["stream"] is True
    assert text == text_of(generate(d["prompt"], 12))
    assert len(data) >= 6, data
    assert headers["x-kvroute-replica"] == pair.decode.url.removeprefix("http://")


def test_the_openai_client_works(pair: Pair) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{pair.url}/v1", api_key="unused", max_retries=0)
    fresh(pair)
    stream = client.completions.create(
        model="tiny", prompt="openai says hello " * 4, max_tokens=10, temperature=0, stream=True
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    [d] = pair.decode.requests
    assert text == text_of(generate(d["prompt"], 10))
    assert d["kv_transfer_params"]["remote_engine_id"] == pair.prefill.engine_id
    fresh(pair)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi there, pair"}], max_tokens=8,
        temperature=0,
    )  # fmt: skip
    [p] = pair.prefill.requests
    [d] = pair.decode.requests
    assert p["kv_transfer_params"] == vllm_prefill_params() and p["prompt"] == d["prompt"]
    assert chat.choices[0].message.content == text_of(generate(d["prompt"], 8))
    assert chat.usage is not None and chat.usage.completion_tokens == 8


@pytest.mark.parametrize("how", ["500", "no-params"])
def test_a_failed_prefill_runs_whole_on_the_decode_backend(pair: Pair, how: str) -> None:
    fresh(pair)
    pair.prefill.fail = how
    body = {"model": "tiny", "prompt": f"fails {how} " * 6, "max_tokens": 7, "stream": True,
            "temperature": 0}  # fmt: skip
    text, _, headers = sse(pair, body)
    assert len(pair.prefill.requests) == 1
    [d] = pair.decode.requests
    assert "kv_transfer_params" not in d  # run whole: nothing to pull
    assert text == text_of(generate(d["prompt"], 7))
    assert headers["x-kvroute-replica"] == pair.decode.url.removeprefix("http://")
    pair.prefill.fail = None


def test_a_prefill_refusal_is_the_clients_openai_style_error(pair: Pair) -> None:
    """A 4xx from the prefill backend is the request's own fault, as from any backend."""
    fresh(pair)
    pair.prefill.fail = "400"
    body = {"model": "tiny", "prompt": "refused " * 6, "max_tokens": 5, "stream": True}
    r = httpx.post(f"{pair.url}/v1/completions", json=body, timeout=60)
    pair.prefill.fail = None
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "stand-in refuses this prompt" in err["message"]
    assert {"message", "type", "param", "code"} <= set(err)
    assert pair.decode.requests == []  # nothing ran on the decode side


def test_an_unreachable_prefill_backend_runs_requests_whole(pair: Pair) -> None:
    """Last in the module: the prefill backend is stopped for good."""
    fresh(pair)
    pair.prefill.stop()
    for i in range(2):  # the first finds it gone; the next is routed without it
        body = {"model": "tiny", "prompt": f"gone {i} " * 6, "max_tokens": 5, "temperature": 0}
        r = httpx.post(f"{pair.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        d = pair.decode.requests[-1]
        assert "kv_transfer_params" not in d
        assert r.json()["choices"][0]["text"] == text_of(generate(d["prompt"], 5))
    assert len(pair.decode.requests) == 2


def test_the_default_priced_split_serves_too() -> None:
    """``--pd-split priced`` (the default) prices vLLM backends with kvroute's default
    coefficients: an idle decode backend keeps a short prompt whole, and either way the
    answer is the decode backend's, right."""
    with router_over("priced") as p:
        body = {"model": "tiny", "prompt": "priced " * 10, "max_tokens": 6, "temperature": 0}
        r = httpx.post(f"{p.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        d = p.decode.requests[-1]
        assert r.json()["choices"][0]["text"] == text_of(generate(d["prompt"], 6))
        assert len(p.prefill.requests) + len(p.decode.requests) in (1, 2)
