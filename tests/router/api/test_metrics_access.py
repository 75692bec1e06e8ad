"""Who may read ``/metrics`` and ``/fleet``, and what ``/metrics`` writes for odd names:
the real front door's app under uvicorn over real HTTP, on one stand-in replica actor (no
Ray, no engine: these endpoints read the front door's own state).

What it pins down (issue 50): ``/metrics`` names every tenant and LoRA adapter with its
traffic, so with keys configured it answers an admin key or the metrics key only (no key:
401, a tenant's key: 403, OpenAI-style bodies); a server without keys answers anyone, as
before. Label values holding a quote, a backslash or a newline read back as they were; a
NUL or another control character never goes out raw. An admin cannot register an adapter
whose name holds one.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kvroute.deploy.http_server import uvicorn_config
from kvroute.router.api.app import create_app
from kvroute.router.fleet.tenants import TenantConfig, Tenants, TenantsFile, hash_key
from kvroute.router.frontdoor import FrontDoor

from ...waiting import wait_for
from ..fleet.test_fleet_membership import Actor
from ..served import assert_clean_error

SPEC = TenantsFile(
    [TenantConfig("alpha", [hash_key("key-a")], adapters=["ad-a"])],
    admin_keys=[hash_key("key-admin")],
)
# What the exposition format escapes (quote, backslash, newline), and what it cannot (NUL,
# ESC, tab): names that reach the series however they came (tenants built in code, a
# ``vllm serve`` backend's adapters), as the front door would label them.
ESCAPED = 'q"uote\\back\nline'
CONTROL = "nul\x00esc\x1btab\t"


@dataclass
class Served:
    url: str
    door: FrontDoor


@contextlib.contextmanager
def served(tenants: Tenants, adapters: dict[str, str] | None = None) -> Iterator[Served]:
    """The app over one stand-in replica, served on a free loopback port."""
    actor = Actor("r0")
    door = FrontDoor(
        [(actor, actor._info())],
        tokenizer=object(),  # never used: no completion is sent
        lora_adapters=adapters,
        lora_resync_s=0,
        monitor_interval_s=60,
    )
    app = create_app(door, tenants)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "uvicorn started")
    try:
        yield Served(f"http://127.0.0.1:{port}", door)
    finally:
        server.should_exit = True
        thread.join(10)


def get(url: str, key: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(url, headers=headers, timeout=10)


@pytest.fixture(scope="module")
def keyed() -> Iterator[Served]:
    with served(Tenants(SPEC, "test-secret", "key-metrics"), {"ad-secret": "/p"}) as s:
        yield s


def test_metrics_and_fleet_need_an_admin_or_the_metrics_key(keyed: Served) -> None:
    keyed.door.metrics.lora_requests.labels("ad-secret").inc()
    for path, admitted in (
        ("/metrics", ("key-admin", "key-metrics")),
        ("/fleet", ("key-admin",)),
    ):
        url = keyed.url + path
        for key in (None, "not-a-key"):
            err = assert_clean_error(get(url, key), 401)
            assert err["code"] == "invalid_api_key" and "ad-secret" not in err["message"]
        err = assert_clean_error(get(url, "key-a"), 403)  # a tenant's key
        assert err["code"] == "not_admin" and err["type"] == "permission_error"
        for key in admitted:
            assert get(url, key).status_code == 200, (path, key)
    err = assert_clean_error(get(keyed.url + "/fleet", "key-metrics"), 403)  # /metrics only
    assert err["code"] == "not_admin"
    scraped = get(keyed.url + "/metrics", "key-metrics").text
    assert 'adapter="ad-secret"' in scraped  # what a tenant's key was kept from
    # The metrics key is no tenant: the API refuses it, saying which door it opens.
    err = assert_clean_error(get(keyed.url + "/v1/models", "key-metrics"), 401)
    assert "/metrics only" in err["message"]
    # A tenant still sees its own adapters alone.
    models = get(keyed.url + "/v1/models", "key-a").json()["data"]
    assert "ad-secret" not in [m["id"] for m in models]


def test_without_keys_metrics_answers_anyone_unless_a_metrics_key_is_set() -> None:
    with served(Tenants(None, "test-secret")) as s:
        assert get(s.url + "/metrics", None).status_code == 200
        assert get(s.url + "/fleet", None).status_code == 200  # loopback only
    with served(Tenants(None, "test-secret", "key-metrics")) as s:
        assert_clean_error(get(s.url + "/metrics", None), 401)
        assert get(s.url + "/metrics", "key-metrics").status_code == 200
        completions = httpx.post(s.url + "/v1/completions", json={}, timeout=10)
        assert completions.status_code == 400  # past the door: only the empty body is wrong


def test_label_values_are_escaped_and_no_control_character_goes_out_raw() -> None:
    weird = {ESCAPED: "/a", CONTROL: "/b"}
    with served(Tenants(SPEC, "test-secret", "key-metrics"), weird) as s:
        series = s.door.metrics
        for name in weird:  # a tenant label (per request) and an adapter label (each kind)
            series.http.labels(name, "200").inc()
            series.lora_requests.labels(name).inc()
        r = get(s.url + "/metrics", "key-metrics")
    assert r.status_code == 200
    raw = r.content
    assert b"\x00" not in raw and b"\x1b" not in raw and b"\t" not in raw
    assert not [b for b in raw if b < 0x20 and b != 0x0A], "a raw control byte"
    got: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(r.text):
        for sample in fam.samples:
            for label in ("tenant", "adapter"):
                if label in sample.labels:
                    got.setdefault(sample.name, set()).add(sample.labels[label])
    visible = "nul\\x00esc\\x1btab\\x09"  # what the format cannot escape, written visibly
    for name in (
        "kvroute:http_requests_total",
        "kvroute:lora_requests_total",
        "kvroute:lora_adapter_replicas",  # read at scrape time (FleetCollector)
    ):
        assert {ESCAPED, visible} <= got[name], (name, got.get(name))


def test_an_adapter_name_with_a_control_character_is_refused(keyed: Served) -> None:
    for name in ("ad\x00x", "ad\nx", "ad\x1b[31mx"):
        r = httpx.post(
            keyed.url + "/v1/load_lora_adapter",
            json={"lora_name": name, "lora_path": "/nowhere"},
            headers={"authorization": "Bearer key-admin"},
            timeout=10,
        )
        err = assert_clean_error(r, 400)
        assert err["param"] == "lora_name" and "control character" in err["message"]
    assert list(keyed.door.loras.paths()) == ["ad-secret"]
