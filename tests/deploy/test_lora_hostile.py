"""Issue 50's hostile-tenant review of LoRA adapters, live: ``kvroute serve --model tiny
--replicas 2`` in its own process, an admin and three tenants, one adapter granted to each.

What must hold: an adapter rewritten on disk after it was loaded (the same tensor names at
another rank) fails its own requests with a 400 naming it -- no replica dies, nothing is
quarantined, and another tenant's (or the same tenant's) same prompt on the base model is
served; a load from a folder whose ``adapter_config.json`` is a FIFO (a stand-in for a hung
mount) fails on its own while every tenant's completions answer in their usual time.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvroute.router.fleet.tenants import hash_key

from ..lora_adapters import make_adapter
from ..ray_session import shutdown
from ..serve_process import kvroute_serve

TENANTS = f"""
admin_keys = ["{hash_key("key-admin")}"]

[[tenants]]
id = "one"
keys = ["{hash_key("key-one")}"]
adapters = ["victim"]

[[tenants]]
id = "two"
keys = ["{hash_key("key-two")}"]
adapters = ["two"]

[[tenants]]
id = "three"
keys = ["{hash_key("key-three")}"]
adapters = ["three", "fifo"]
"""
QV = {"lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
PROMPT = "The prompt every tenant sends, on its adapter and on the base model."
ADMIN = {"authorization": "Bearer key-admin"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    shutdown()  # kvroute serve starts a Ray of its own: none of this process's may linger
    root = tmp_path_factory.mktemp("hostile")
    made = {
        "victim": make_adapter(root / "victim", 1, r=8, **QV),
        "two": make_adapter(root / "two", 2, r=8, **QV),
        "three": make_adapter(root / "three", 3, r=8, lora_alpha=8, target_modules=["o_proj"]),
        "rank4": make_adapter(root / "rank4", 4, r=4, **QV),  # the victim's names, at r=4
    }
    (root / "tenants.toml").write_text(TENANTS)
    args = ["--model", "tiny", "--replicas", "2", "--max-loras", "2",
            "--tenants", str(root / "tenants.toml"), "--fleet-secret", "hostile-lora",
            "--lora-modules", f"two={made['two']}", f"three={made['three']}"]  # fmt: skip
    with kvroute_serve(args) as url:
        yield {"url": url, "made": made, "root": root}


def complete(served: dict[str, Any], key: str, model: str, timeout: float = 60) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(served["url"] + "/v1/completions", json=body, headers=headers,
                      timeout=timeout)  # fmt: skip


def replicas(served: dict[str, Any]) -> dict[str, dict[str, Any]]:
    fleet = httpx.get(served["url"] + "/fleet", headers=ADMIN, timeout=30).json()
    return {r["replica_id"]: r for r in fleet["replicas"]}


def test_a_rewritten_adapter_fails_its_own_requests_and_kills_no_replica(
    served: dict[str, Any],
) -> None:
    made = served["made"]
    victim = Path(shutil.copytree(made["victim"], served["root"] / "victim-live"))
    load = {"lora_name": "victim", "lora_path": str(victim)}
    r = httpx.post(served["url"] + "/v1/load_lora_adapter", json=load, headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    before = {rid: (r["incarnation"], r["pid"]) for rid, r in replicas(served).items()}
    shutil.copy(Path(made["rank4"]) / "adapter_model.safetensors",
                victim / "adapter_model.safetensors")  # fmt: skip

    for _ in range(4):  # each replica it reaches reads it, and refuses it alone
        bad = complete(served, "key-one", "victim")
        assert bad.status_code == 400, bad.text
        err = bad.json()["error"]
        assert err["param"] == "model" and "LoRA adapter 'victim' changed on disk" in err["message"]
        assert "registered [" in err["message"] and str(victim) not in err["message"]
    # The same prompt: another tenant's, and the same tenant's, on the base model; other
    # tenants' adapters. None is quarantined, none waits on a restart.
    for key, model in (("key-two", "tiny"), ("key-one", "tiny"), ("key-three", "tiny"),
                       ("key-two", "two"), ("key-three", "three")):  # fmt: skip
        ok = complete(served, key, model)
        assert ok.status_code == 200, (key, model, ok.text)
    after = replicas(served)
    assert {rid: (r["incarnation"], r["pid"]) for rid, r in after.items()} == before
    assert all(r["healthy"] and r["failures"] == 0 for r in after.values())
    metrics = httpx.get(served["url"] + "/metrics", headers=ADMIN, timeout=30).text
    assert 'kvroute:errors_total{kind="replica_failure"}' not in metrics
    assert "kvroute:quarantined_requests 0.0" in metrics
    assert "kvroute:lora_read_failures_total{" in metrics  # the replicas' count, per replica


def test_a_fifo_for_a_config_fails_its_load_and_stalls_no_tenant(served: dict[str, Any]) -> None:
    folder = served["root"] / "fifo"
    shutil.copytree(served["made"]["two"], folder)
    (folder / "adapter_config.json").unlink()
    os.mkfifo(folder / "adapter_config.json")
    answer: list[tuple[int, str, float]] = []

    def load() -> None:
        t0 = time.monotonic()
        body = {"lora_name": "fifo", "lora_path": str(folder)}
        try:
            r = httpx.post(served["url"] + "/v1/load_lora_adapter", json=body, headers=ADMIN,
                           timeout=60)  # fmt: skip
            answer.append((r.status_code, r.text, time.monotonic() - t0))
        except httpx.HTTPError as exc:
            answer.append((0, repr(exc), time.monotonic() - t0))

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    try:
        time.sleep(0.3)  # the load is on the replicas now
        for key, model in (("key-one", "tiny"), ("key-two", "two"), ("key-three", "three"),
                           ("key-two", "tiny")):  # fmt: skip
            t0 = time.monotonic()
            r = complete(served, key, model, timeout=15)
            took = time.monotonic() - t0
            assert r.status_code == 200 and took < 5, (key, model, r.status_code, took)
        thread.join(60)
        ((status, text, took),) = answer
        assert status == 400 and "not a regular file" in text and "lora_path" in text, text
        assert took < 25, took  # within the read deadline (20 s), here at once
        assert complete(served, "key-three", "fifo").status_code == 404  # never loaded
    finally:
        try:  # a reader blocked on the FIFO (before the fix) gets its end of file
            os.close(os.open(folder / "adapter_config.json", os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass  # nobody reads it: as it should be
