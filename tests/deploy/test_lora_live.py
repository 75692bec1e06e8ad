"""Issue 37's live goal: ``kvroute serve --model tiny --replicas 2 --lora-modules ...``
with six random adapters, as a user runs it (its own process, Ray actors, uvicorn), and
the official ``openai`` client.

What must hold: each adapter called by name gives transformers + PEFT's greedy tokens for
that adapter; a repeated prefix is a cache hit under the same adapter (every time: the
router hashes the adapter as the replicas do, so it sends the repeat where the prefix is)
and a miss under another; a tenant without the grant gets a 404; an adapter loaded and
unloaded through the API while requests run fails none of them, and those running on an
adapter while it is unloaded finish whole.
"""

from __future__ import annotations

import random
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from kvroute.replica.model.models import tiny_model_path
from kvroute.router.fleet.tenants import hash_key

from ..lora_adapters import make_adapter, make_adapters, peft_reference
from ..ray_session import shutdown
from ..serve_process import kvroute_serve

NEW_TOKENS = 8
TENANTS = f"""
admin_keys = ["{hash_key("key-admin")}"]

[[tenants]]
id = "all"
keys = ["{hash_key("key-all")}"]
adapters = ["*"]

[[tenants]]
id = "few"
keys = ["{hash_key("key-few")}"]
adapters = ["ad0"]
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    shutdown()  # kvroute serve starts a Ray of its own: none of this process's may linger
    root = tmp_path_factory.mktemp("live-lora")
    adapters = make_adapters(root, 6)
    extra = make_adapter(root / "extra", 77, r=8, lora_alpha=16, target_modules=["v_proj"])
    (root / "tenants.toml").write_text(TENANTS)
    # fp32 whatever the host: the reference is PEFT in fp32 (serve takes bf16 on CUDA)
    args = ["--model", "tiny", "--replicas", "2", "--dtype", "float32",
            "--max-loras", "2", "--max-cpu-loras", "7",
            "--tenants", str(root / "tenants.toml"), "--fleet-secret", "live-lora-test",
            "--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]  # fmt: skip
    with kvroute_serve(args) as url:
        yield {"url": url, "adapters": adapters, "extra": extra}


def client(served: dict[str, Any], key: str = "key-all") -> openai.OpenAI:
    return openai.OpenAI(base_url=served["url"] + "/v1", api_key=key, max_retries=0, timeout=120)


def test_each_adapter_by_name_gives_peft_s_tokens(served: dict[str, Any]) -> None:
    adapters = served["adapters"]
    reference = peft_reference({**adapters, "extra": served["extra"]}, NEW_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    rng = random.Random(37)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 23, 40)]
    c = client(served)
    texts: dict[str | None, list[str]] = {}
    for name in [None, *adapters]:
        for prompt in prompts:
            out = c.completions.create(model=name or "tiny", prompt=prompt,
                                       max_tokens=NEW_TOKENS, temperature=0)  # fmt: skip
            want = tokenizer.decode(reference(name, prompt), skip_special_tokens=True)
            assert out.choices[0].text == want, (name, len(prompt))
            assert out.model == (name or "tiny")
            texts.setdefault(name, []).append(out.choices[0].text)
    # Every adapter changes the output: the comparison above could have failed.
    assert len({tuple(t) for t in texts.values()}) == len(texts)


def test_a_repeated_prefix_hits_under_its_adapter_only(served: dict[str, Any]) -> None:
    c = client(served)
    prefix = "A long shared system prompt that every turn of this tenant repeats. " * 3

    def cached(model: str, tail: str) -> int:
        out = c.completions.create(model=model, prompt=prefix + tail, max_tokens=2,
                                   temperature=0)  # fmt: skip
        details = out.usage.prompt_tokens_details
        return details.cached_tokens if details and details.cached_tokens else 0

    before = lora_requests(served, "ad1")
    assert cached("ad1", "first") == 0
    hits = [cached("ad1", f"turn {i}") for i in range(4)]  # wherever the router sends them
    assert min(hits) >= 192, hits  # the prefix's full blocks (12 of 16 tokens), each time
    assert cached("ad2", "turn 9") == 0  # same tokens, another adapter: nothing shared
    assert cached("tiny", "turn 9") == 0  # nor the base model
    assert lora_requests(served, "ad1") == before + 5  # /metrics counts them by adapter


def lora_requests(served: dict[str, Any], adapter: str) -> float:
    admin = {"authorization": "Bearer key-admin"}  # /metrics: an admin key (or the metrics key)
    metrics = httpx.get(served["url"] + "/metrics", headers=admin).text
    found = re.search(rf'^kvroute:lora_requests_total{{adapter="{adapter}"}} (\S+)$', metrics, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_tenant_without_the_grant_gets_a_404(served: dict[str, Any]) -> None:
    few = client(served, "key-few")
    assert few.completions.create(model="ad0", prompt="hi", max_tokens=1).choices
    for model in ("ad1", "no-such-adapter"):
        with pytest.raises(openai.NotFoundError) as info:
            few.completions.create(model=model, prompt="hi", max_tokens=1)
        assert info.value.body["param"] == "model"  # type: ignore[index]
    assert [m.id for m in few.models.list().data] == ["tiny", "ad0"]


def test_load_and_unload_while_traffic_runs_fail_no_request(served: dict[str, Any]) -> None:
    c = client(served)
    admin = {"authorization": "Bearer key-admin"}
    stop = threading.Event()
    results: list[str] = []  # one finish reason per background request (or its error)

    def traffic(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            model = rng.choice(["tiny", "ad0", "ad1", "ad2", "ad3", "ad4"])
            try:
                out = c.completions.create(model=model, prompt=f"traffic {rng.random()}",
                                           max_tokens=4, temperature=0)  # fmt: skip
                results.append(out.choices[0].finish_reason)
            except Exception as exc:  # counted, not raised: the assertion below says it
                results.append(f"{type(exc).__name__}: {exc}")

    def stream_extra(i: int) -> tuple[str | None, int]:
        chunks = c.completions.create(model="extra", prompt=f"stream {i}", max_tokens=48,
                                      temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})  # fmt: skip
        reason, n = None, 0
        for n, chunk in enumerate(chunks, 1):
            reason = chunk.choices[0].finish_reason or reason
            if n == 1:
                started.release()
        return reason, n

    started = threading.Semaphore(0)
    with ThreadPoolExecutor(6) as pool:
        background = [pool.submit(traffic, s) for s in range(2)]
        load = {"lora_name": "extra", "lora_path": served["extra"]}
        r = httpx.post(served["url"] + "/v1/load_lora_adapter", json=load, headers=admin,
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        streams = [pool.submit(stream_extra, i) for i in range(3)]
        for _ in streams:  # each stream has its first token: it runs on its replica
            assert started.acquire(timeout=120)
        r = httpx.post(served["url"] + "/v1/unload_lora_adapter", json={"lora_name": "extra"},
                       headers=admin, timeout=120)  # fmt: skip
        assert r.status_code == 200, r.text
        finished = [s.result(timeout=120) for s in streams]
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="extra", prompt="after", max_tokens=1)
        r = httpx.post(served["url"] + "/v1/load_lora_adapter", json=load, headers=admin,
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text  # and back again, under traffic
        assert c.completions.create(model="extra", prompt="back", max_tokens=2).choices
        stop.set()
        for b in background:
            b.result(timeout=120)
    assert all(reason == "length" for reason, _ in finished), finished  # all 48, unaborted
    assert results and all(r in ("length", "stop") for r in results), [
        r for r in results if r not in ("length", "stop")
    ]
