"""Tenants at the HTTP front door: API keys and cache salts (no server), a replica that hashes
differently refused, and over real HTTP a tenants file's limits, admission before the body,
and who may see /fleet."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import msgspec
import pytest

from kvroute.events.replica_api import ReplicaInfo
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

from ...waiting import wait_for
from ..served import assert_clean_error
from .http_fleet import CONFIG, ENDLESS, KEYS, MODEL


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
