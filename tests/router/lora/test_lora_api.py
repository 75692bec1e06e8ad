"""LoRA adapters through the HTTP front door, with real parts: a local Ray, replica actors
of ``tiny`` serving random PEFT adapters, the FastAPI app under uvicorn, httpx and the
official ``openai`` client.

What it pins down: ``model`` names an adapter only for a tenant granted it, and an adapter
a tenant may not use answers exactly as one that does not exist; ``/v1/models`` lists what
the caller may use; loading and unloading need an admin key and name the field at fault;
a replica that joins or restarts holds every registered adapter before it is routed to.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import ray
import uvicorn

from kvroute.deploy.http_server import uvicorn_config
from kvroute.replica.serve.actor import start_replica
from kvroute.router.api.app import create_app
from kvroute.router.fleet.tenants import TenantConfig, Tenants, TenantsFile, hash_key
from kvroute.router.frontdoor import FrontDoor
from kvroute.router.lora.registry import prepare_fleet

from ...lora_adapters import make_adapter, make_adapters
from ...ray_session import local_ray
from ...waiting import wait_for

CONFIG = {"model": "tiny", "block_size": 16, "num_blocks": 128, "enable_lora": True,
          "max_loras": 2}  # fmt: skip
TENANTS = TenantsFile(
    [
        TenantConfig("alpha", [hash_key("key-a")], adapters=["ad0"]),
        TenantConfig("beta", [hash_key("key-b")]),  # the base model only
        TenantConfig("gamma", [hash_key("key-g")], adapters=["*"]),
    ],
    admin_keys=[hash_key("key-admin")],
)
PROMPT = "Adapters for every tenant, cached apart and routed where they live. " * 2


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    made = make_adapters(root, 3)
    made["rank32"] = make_adapter(root / "rank32", 7, r=32, target_modules=["q_proj"])
    return made


@pytest.fixture(scope="module")
def fleet(adapters: dict[str, str]) -> Iterator[dict[str, Any]]:
    start = {"ad0": adapters["ad0"], "ad1": adapters["ad1"]}
    with local_ray() as started:
        actors = [
            start_replica(f"r{i}", {**CONFIG, "lora_modules": start}, num_cpus=0.5,
                          torch_threads=1)
            for i in range(2)
        ]  # fmt: skip
        started.extend(actors)
        infos = ray.get([a.info.remote() for a in actors], timeout=120)
        held = asyncio.run(
            prepare_fleet({i.replica_id: a for a, i in zip(actors, infos, strict=True)})
        )
        door = FrontDoor(list(zip(actors, infos, strict=True)), lora_adapters=held.paths,
                         lora_holders=held.holders, monitor_interval_s=0.5)  # fmt: skip
        app = create_app(door, Tenants(TENANTS, "test-secret"))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        wait_for(lambda: server.started, 30, "uvicorn started")
        yield {"url": f"http://127.0.0.1:{port}", "door": door, "held": held}
        server.should_exit = True
        thread.join(10)


def post(fleet: dict[str, Any], path: str, key: str | None, body: dict[str, Any]) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(fleet["url"] + path, json=body, headers=headers, timeout=60)


def complete(fleet: dict[str, Any], key: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    return post(fleet, "/v1/completions", key, body)


def error_of(resp: httpx.Response, name: str) -> dict[str, Any]:
    """The error body with the request's own id and the model's name taken out."""
    err = dict(resp.json()["error"])
    err.pop("request_id", None)
    err["message"] = err["message"].replace(name, "NAME")
    return err


def test_the_fleet_starts_with_its_replicas_adapters(fleet: dict[str, Any], adapters) -> None:  # type: ignore[no-untyped-def]
    assert fleet["held"].paths == {"ad0": adapters["ad0"], "ad1": adapters["ad1"]}
    assert fleet["held"].holders == {"ad0": {"r0", "r1"}, "ad1": {"r0", "r1"}}


def test_an_adapter_without_a_grant_is_the_same_404_as_none(fleet: dict[str, Any]) -> None:
    assert complete(fleet, "key-a", "ad0").status_code == 200  # granted
    ungranted = complete(fleet, "key-a", "ad1")  # registered, not alpha's
    missing = complete(fleet, "key-a", "zz9")  # registered by nobody (same length)
    assert ungranted.status_code == missing.status_code == 404
    assert (
        error_of(ungranted, "ad1")
        == error_of(missing, "zz9")
        == {
            "message": "The model `NAME` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": "model_not_found",
        }
    )
    assert set(ungranted.headers) == set(missing.headers)
    # /tokenize answers the same way: the base model's tokenizer for a granted adapter.
    assert post(fleet, "/tokenize", "key-a", {"model": "ad0", "prompt": "hi"}).status_code == 200
    tok_ungranted = post(fleet, "/tokenize", "key-a", {"model": "ad1", "prompt": "hi"})
    tok_missing = post(fleet, "/tokenize", "key-a", {"model": "zz9", "prompt": "hi"})
    assert tok_ungranted.status_code == tok_missing.status_code == 404
    assert error_of(tok_ungranted, "ad1") == error_of(tok_missing, "zz9")
    assert complete(fleet, "key-b", "ad0").status_code == 404  # beta: the base model only
    assert complete(fleet, "key-b", "tiny").status_code == 200
    assert complete(fleet, "key-g", "ad1").status_code == 200  # gamma: every adapter
    # The official client sees a NotFoundError, as against vLLM.
    client = openai.OpenAI(base_url=fleet["url"] + "/v1", api_key="key-a", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="ad1", prompt="x", max_tokens=1)


def test_models_lists_the_adapters_the_caller_may_use(fleet: dict[str, Any], adapters) -> None:  # type: ignore[no-untyped-def]
    def listed(key: str) -> dict[str, tuple[str | None, str | None]]:
        client = openai.OpenAI(base_url=fleet["url"] + "/v1", api_key=key, max_retries=0)
        return {m.id: (getattr(m, "parent", None), getattr(m, "root", None))
                for m in client.models.list().data}  # fmt: skip

    base_root = fleet["door"].fleet.model_path
    assert listed("key-a") == {"tiny": (None, base_root), "ad0": ("tiny", adapters["ad0"])}
    assert listed("key-b") == {"tiny": (None, base_root)}
    assert set(listed("key-g")) == {"tiny", "ad0", "ad1"}


def test_load_and_unload_need_the_admin_key_and_name_the_field(
    fleet: dict[str, Any], adapters: dict[str, str]
) -> None:
    load = {"lora_name": "ad2", "lora_path": adapters["ad2"]}
    assert post(fleet, "/v1/load_lora_adapter", None, load).status_code == 401
    assert post(fleet, "/v1/load_lora_adapter", "key-nope", load).status_code == 401
    assert post(fleet, "/v1/load_lora_adapter", "key-g", load).status_code == 403
    assert complete(fleet, "key-g", "ad2").status_code == 404  # not loaded yet
    refused = [
        ({"lora_path": adapters["ad2"]}, "lora_name"),
        ({"lora_name": "x"}, "lora_path"),
        ({"lora_name": "x", "lora_path": "/no/such/folder"}, "lora_path"),
        ({"lora_name": "x", "lora_path": str(Path(adapters["ad2"]).parent)}, "lora_path"),
        ({"lora_name": "x", "lora_path": adapters["rank32"]}, "lora_path"),  # rank 32 > 16
        ({"lora_name": "ad0", "lora_path": adapters["ad2"]}, "lora_name"),  # taken
        ({"lora_name": "tiny", "lora_path": adapters["ad2"]}, "lora_name"),  # the base
    ]
    for body, field in refused:
        resp = post(fleet, "/v1/load_lora_adapter", "key-admin", body)
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["error"]["param"] == field, (body, resp.text)
    assert "rank" in post(fleet, "/v1/load_lora_adapter", "key-admin", refused[4][0]).text
    ok = post(fleet, "/v1/load_lora_adapter", "key-admin", load)
    assert ok.status_code == 200, ok.text
    assert complete(fleet, "key-g", "ad2").status_code == 200
    assert complete(fleet, "key-a", "ad2").status_code == 404  # alpha has no grant
    unload = {"lora_name": "ad2"}
    assert post(fleet, "/v1/unload_lora_adapter", "key-a", unload).status_code == 403
    assert post(fleet, "/v1/unload_lora_adapter", "key-admin", unload).status_code == 200
    assert complete(fleet, "key-g", "ad2").status_code == 404
    gone = post(fleet, "/v1/unload_lora_adapter", "key-admin", unload)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
    held = [ray.get(r.actor.list_loras.remote()) for r in fleet["door"].fleet.replicas.values()]
    assert all(set(h) == {"ad0", "ad1"} for h in held)  # no refused load left a trace


async def test_a_replica_that_joins_or_restarts_holds_every_adapter(
    adapters: dict[str, str],
) -> None:
    """Scale-up and a Ray restart: the newcomer starts with none of the adapters loaded at
    run time (or none at all), and gets them all before it is routed to."""
    with local_ray() as started:
        first = start_replica("j0", {**CONFIG, "lora_modules": {"ad0": adapters["ad0"]}},
                              num_cpus=0.5, torch_threads=1)  # fmt: skip
        started.append(first)
        info = await first.info.remote()
        held = await prepare_fleet({"j0": first})
        door = FrontDoor([(first, info)], lora_adapters=held.paths, lora_holders=held.holders,
                         monitor_interval_s=0.3)  # fmt: skip
        door.start()
        try:
            await door.load_lora("ad1", adapters["ad1"])
            late = start_replica("j1", CONFIG, num_cpus=0.5, torch_threads=1, max_restarts=1)
            started.append(late)
            assert await late.list_loras.remote() == {}
            assert await door.add_replica(late) == "j1"
            assert "j1" in door.fleet.routable()
            want = {"ad0": adapters["ad0"], "ad1": adapters["ad1"]}
            assert await late.list_loras.remote() == want == door.loras.paths()
            assert door.loras.holder_map() == {"ad0": {"j0", "j1"}, "ad1": {"j0", "j1"}}
            # A restart (Ray brings the actor back with its start-up config: no adapters).
            old = door.fleet.replicas["j1"].info.incarnation
            ray.kill(late, no_restart=False)
            for _ in range(600):
                rep = door.fleet.replicas["j1"]
                if rep.info.incarnation != old and rep.alive:
                    break
                await asyncio.sleep(0.1)
            assert door.fleet.replicas["j1"].info.incarnation != old
            assert "j1" in door.fleet.routable()
            assert await late.list_loras.remote() == want
            assert door.loras.holder_map() == {"ad0": {"j0", "j1"}, "ad1": {"j0", "j1"}}
        finally:
            await door.close()


def test_an_unload_waits_for_the_requests_running_on_the_adapter(
    fleet: dict[str, Any], adapters: dict[str, str]
) -> None:
    """A stream on the adapter is running when the unload comes: it finishes whole, and
    the unload answers only after it has ended (then the name is gone everywhere)."""
    load = {"lora_name": "ad2", "lora_path": adapters["ad2"]}
    assert post(fleet, "/v1/load_lora_adapter", "key-admin", load).status_code == 200
    client = openai.OpenAI(base_url=fleet["url"] + "/v1", api_key="key-g", max_retries=0)
    stream = client.completions.create(model="ad2", prompt=PROMPT, max_tokens=400,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    chunks = iter(stream)
    next(chunks)  # it runs on its replica now
    assert fleet["door"].loras.in_flight["ad2"] == 1
    loras = fleet["door"].loras
    seen: list[tuple[int, int]] = []  # (status, the adapter's requests running then)

    def unload() -> None:
        r = post(fleet, "/v1/unload_lora_adapter", "key-admin", {"lora_name": "ad2"})
        seen.append((r.status_code, loras.in_flight["ad2"]))

    thread = threading.Thread(target=unload)
    thread.start()
    reason = None
    for chunk in chunks:
        reason = chunk.choices[0].finish_reason or reason
    thread.join(120)
    assert reason == "length"  # all 400 tokens: the unload did not cut it
    assert seen == [(200, 0)]  # it answered once no request ran on the adapter
    assert complete(fleet, "key-g", "ad2").status_code == 404
