"""``kvroute serve --routers 2`` with LoRA adapters, as a user runs it: an adapter loaded
or unloaded through whichever front door took the call is seen by both (issue 37: they
share the registry actor; with a registry each, the other front door never listed it).

The two front doors share the port (``SO_REUSEPORT``): each new connection lands on one of
them, so many fresh connections in a row that all agree have asked both."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from kvroute.router.fleet.tenants import hash_key

from ..lora_adapters import SHAPES, make_adapter
from ..ray_session import shutdown
from ..serve_process import kvroute_serve
from ..waiting import wait_for

TENANTS = f"""
admin_keys = ["{hash_key("key-admin")}"]

[[tenants]]
id = "all"
keys = ["{hash_key("key-all")}"]
adapters = ["*"]
"""
ADMIN = {"authorization": "Bearer key-admin"}
USER = {"authorization": "Bearer key-all"}
FRESH = 24  # new connections per check: both front doors answer some (1 in 2**23 not)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    shutdown()  # kvroute serve starts a Ray of its own: none of this process's may linger
    root = tmp_path_factory.mktemp("routers-lora")
    ad0 = make_adapter(root / "ad0", 41, **SHAPES[0])
    extra = make_adapter(root / "extra", 42, **SHAPES[4])
    (root / "tenants.toml").write_text(TENANTS)
    args = ["--model", "tiny", "--replicas", "2", "--routers", "2", "--max-loras", "2",
            "--tenants", str(root / "tenants.toml"), "--fleet-secret", "routers-lora-test",
            "--lora-modules", f"ad0={ad0}"]  # fmt: skip
    with kvroute_serve(args) as url:
        yield {"url": url, "extra": extra}


def every_door(check: Callable[[httpx.Client], bool]) -> bool:
    """``check`` on ``FRESH`` new connections in a row (no keep-alive): all true."""
    for _ in range(FRESH):
        with httpx.Client(timeout=60, headers={"connection": "close"}) as c:
            if not check(c):
                return False
    return True


def test_a_change_through_one_front_door_is_seen_by_both(served: dict[str, Any]) -> None:
    url = served["url"]

    def lists(name: str) -> Callable[[httpx.Client], bool]:
        def check(c: httpx.Client) -> bool:
            r = c.get(url + "/v1/models", headers=USER)
            return r.status_code == 200 and name in {m["id"] for m in r.json()["data"]}

        return check

    assert every_door(lists("ad0"))
    body = {"lora_name": "extra", "lora_path": served["extra"]}
    r = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=ADMIN, timeout=120)
    assert r.status_code == 200, r.text
    wait_for(lambda: every_door(lists("extra")), 10, "both front doors list extra")
    again = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=ADMIN, timeout=120)
    assert again.status_code == 400, again.text  # loaded already, whichever door is asked

    def runs(c: httpx.Client) -> bool:
        body = {"model": "extra", "prompt": "Two front doors, one registry.", "max_tokens": 2}
        return c.post(url + "/v1/completions", json=body, headers=USER).status_code == 200

    assert every_door(runs)
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "extra"},
                   headers=ADMIN, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    wait_for(lambda: every_door(lambda c: not lists("extra")(c)), 10, "neither lists extra")
