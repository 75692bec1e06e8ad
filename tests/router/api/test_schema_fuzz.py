"""Hostile input from the front door's own OpenAPI schema (schemathesis): every documented
field of the completion endpoints and the Responses API, fuzzed, against a live fleet.

What must hold whatever arrives: no 5xx, every refusal an OpenAI-style error body with a
request id and no internals, no replica failing or restarting, ``/health`` ok at the end.
Cost-model replicas with a small cache keep each case short (a long ``max_tokens`` is
bounded by the cache); their request validation and engine are the real ones.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from kvroute.router.api.openai_api import UNSUPPORTED

from ..served import LEAKS, Served, serve_sim

MODEL = "sim:h100-8b"
SIM = {"model": MODEL, "block_size": 16, "num_blocks": 256, "time_scale": 0.02}
AUTH = {"Authorization": "Bearer key-a"}
EXAMPLES = 60  # per endpoint


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve_sim("z", 2, SIM) as s:
        yield s


def aimed(case: Any) -> Any:
    """Half the cases name the served model, so they get past the model check and reach
    validation, tokenization and the engine; half of those also leave out the parameters
    the server refuses by design whatever their type (UNSUPPORTED: a fuzzer fills most of
    them, and a case carrying one never reaches the engine) and send one prompt of a batch.
    The rest keep whatever was generated."""
    if isinstance(case.body, dict) and (h := zlib.crc32(repr(case.body).encode())) % 2:
        case.body["model"] = MODEL
        if h % 4 == 1:
            for name in UNSUPPORTED:
                case.body.pop(name, None)
            prompt = case.body.get("prompt")
            if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
                case.body["prompt"] = prompt[:1]  # one choice: a batch (up to 64) would run long
    return case


@pytest.mark.parametrize(
    "path",
    ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"],
)
def test_fuzzed_bodies_never_get_a_5xx_or_hurt_a_replica(served: Served, path: str) -> None:
    schema = schemathesis.openapi.from_url(served.url + "/openapi.json")
    statuses: Counter[int] = Counter()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        derandomize=True,  # the same cases every run: how many are valid must not vary
    )
    @given(case=schema[path]["POST"].as_strategy().map(aimed))
    def fuzz(case: Any) -> None:
        r = case.call(base_url=served.url, headers=AUTH, timeout=120)
        statuses[r.status_code] += 1
        assert r.status_code < 500, (case.body, r.text[:500])
        if r.status_code >= 400:
            err = r.json()["error"]
            rid = r.headers["x-request-id"]  # schemathesis keeps every header as a list
            assert err["message"] and [err["request_id"]] == (
                rid if isinstance(rid, list) else [rid]
            )
            assert not any(leak in r.text for leak in LEAKS), r.text[:500]

    fuzz()
    door = served.door
    print(f"\nschema fuzz {path}: {sum(statuses.values())} cases, statuses {dict(statuses)}")
    assert statuses[200] >= 1  # some cases were valid and ran on a replica
    assert door.errors["replica_failure"] == 0 and door.errors["internal"] == 0
    assert all(rep.restarts == 0 and rep.alive for rep in door.fleet.replicas.values())
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200
