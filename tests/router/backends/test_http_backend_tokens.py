"""``kvroute router --backend`` in front of ``vllm serve`` with vLLM's default prefix-cache
hash, ``--prefix-caching-hash-algo sha256`` (a pickle kvroute cannot reproduce): the router
indexes its KV events by their token ids and extra keys (events/translate.py).

Runs where vLLM imports; skipped elsewhere. Two ``vllm serve`` of the built-in ``tiny``
model start for the module (about 90 s on 2 shared CPU cores).

What it proves, against live vLLM: the router starts (where it refused before) and says
in one line that each backend is indexed by token ids; each backend's blocks reach the
index under the router's own hashes of the tenant's salted prompt, so a repeated prefix
goes back to the backend holding it and is served from its cache; another tenant's
identical prompt finds nothing there.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from ...waiting import wait_for
from .test_http_backend import Fleet, cached, complete, index_blocks, prompt, serve_backends

pytestmark = pytest.mark.slow
PREDICTION_TTL_S = 10.0  # router/routing/policy.py's default


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with serve_backends(tmp_path_factory.mktemp("vllm-sha256"), "sha256") as served:
        yield served


def test_the_router_says_each_backend_is_indexed_by_token_ids(fleet: Fleet) -> None:
    said = [line for line in fleet.log if "indexed by its events' token ids" in line]
    assert len(said) == len(fleet.backends), "".join(fleet.log)
    assert all("vllm:sha256" in line for line in said)


def test_a_repeated_prefix_goes_to_the_backend_holding_it(fleet: Fleet) -> None:
    holders = {}
    for i in range(6):
        rid, body = complete(fleet, prompt(i))
        assert cached(body) == 0
        holders[i] = rid
    # Their translated KV events reached the index (not only the router's predictions).
    for rid in set(holders.values()):
        wait_for(lambda rid=rid: index_blocks(fleet, rid) > 0, what=f"{rid}'s blocks indexed")
    # The router also predicts a routed request's blocks on its replica for 10 s (kv's
    # prediction_ttl_s): let those lapse, so only the translated events can place repeats.
    time.sleep(PREDICTION_TTL_S + 1)
    for i, holder in holders.items():
        rid, body = complete(fleet, prompt(i) + " and a new question?")
        assert rid == holder, f"prompt {i} went to {rid}, its prefix is on {holder}"
        assert cached(body) >= 32  # at least one whole block served from vLLM's cache


def test_another_tenants_identical_prompt_finds_nothing(fleet: Fleet) -> None:
    text = prompt(200)
    _, first = complete(fleet, text, "key-a")
    _, again = complete(fleet, text, "key-a")
    assert cached(first) == 0 and cached(again) > 0
    _, other = complete(fleet, text, "key-b")
    assert cached(other) == 0
