"""Intake without HTTP: a request's body, tenant and id in, started runs out -- the real
front door over a real in-process replica of the tiny model, no server, no Ray actor.

What it proves: the intake core is usable on plain data (bytes, or a coroutine that reads
them once admitted); it fills the served model, tokenizes as the tokenizer does, builds
the sampling, names each choice's run after the request and routes it to a replica whose
first token is counted there; what it refuses is a status, with every admission ticket
given back; and a request admission refuses is never read.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from transformers import AutoTokenizer

from kvroute.replica.serve.actor import ReplicaServer
from kvroute.router.api.errors import APIError
from kvroute.router.api.intake import Intake
from kvroute.router.api.openai_api import CompletionRequest
from kvroute.router.fleet.tenants import Tenant, Tenants, tenants_from_api_keys
from kvroute.router.frontdoor import FrontDoor

CONFIG = {"model": "tiny", "block_size": 16, "num_blocks": 64}


@pytest.fixture(scope="module")
def replica() -> Iterator[ReplicaServer]:
    server = ReplicaServer("r0", {"device": "cpu", **CONFIG}, torch_threads=1)
    try:
        yield server
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def tokenizer(replica: ReplicaServer) -> Any:
    return AutoTokenizer.from_pretrained(replica.info().model_path)


@pytest.fixture(scope="module")
def tenant() -> Tenant:
    return Tenants(tenants_from_api_keys({"key-a": "alpha"}), "secret").authenticate("Bearer key-a")


def door_over(replica: ReplicaServer, tokenizer: Any, **kw: Any) -> FrontDoor:
    """A front door not started (no monitor: its one replica is no Ray actor); its
    connection to the replica is made on first use, on the test's loop."""
    return FrontDoor([(replica, replica.info())], tokenizer=tokenizer, **kw)


@pytest.fixture
async def door(replica: ReplicaServer, tokenizer: Any) -> AsyncIterator[FrontDoor]:
    door = door_over(replica, tokenizer)
    yield door
    await door.close()


def intake_of(door: FrontDoor) -> Intake:
    return Intake(door.admission, door.fleet, door.tokenizer, door.run, "served-name")


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


async def test_a_completion_goes_from_bytes_to_its_tokens(
    door: FrontDoor, tenant: Tenant, tokenizer: Any
) -> None:
    intake = intake_of(door)
    try:
        raw = body(prompt="Hello, router", max_tokens=4, temperature=0)
        admitted = await intake.begin(tenant, CompletionRequest, raw, "req-1")
        assert admitted.body.model == "served-name"  # none named: the one served
        assert admitted.prompts == ["Hello, router"]
        [run] = admitted.runs
        assert run.request_id == "req-1" and run.replica == "r0" and run.tenant == "alpha"
        assert run.request.prompt_token_ids == list(tokenizer("Hello, router").input_ids)
        spec = run.request.sampling
        assert spec.max_tokens == 4 and spec.temperature == 0
        assert door.admission.in_flight == 1 and door.counters["requests"] == 1
        d = await run.first_delta()
        while not d.finished:
            d = await run.next()
        assert d.finish_reason == "length" and d.num_output_tokens == 4
        run.close()
        assert door.admission.in_flight == 0
        assert door.fleet.replicas["r0"].routed == 1  # counted at its first token
    finally:
        intake.close()


async def test_choices_are_runs_named_after_the_request_and_read_once_admitted(
    door: FrontDoor, tenant: Tenant
) -> None:
    intake = intake_of(door)
    reads = 0

    async def read() -> bytes:
        nonlocal reads
        reads += 1
        return body(model="tiny", prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=2, seed=11)

    try:
        admitted = await intake.begin(tenant, CompletionRequest, read, "req-2")
        runs = admitted.runs
        assert reads == 1 and admitted.body.model == "tiny"  # the fleet's own name
        assert [r.request_id for r in runs] == [f"req-2-{i}" for i in range(4)]
        assert [r.request.prompt_token_ids for r in runs] == [[5, 6, 7]] * 2 + [[8, 9]] * 2
        assert [r.request.sampling.seed for r in runs] == [11, 12, 11, 12]  # n apart
        assert door.admission.in_flight == 4
        for run in runs:
            await run.first_delta()
            run.close()
        assert door.admission.in_flight == 0
    finally:
        intake.close()


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"prompt": "x", "max_tokens": 5000}, "max_tokens", "context_length_exceeded"),
        ({"prompt": "x", "best_of": 3, "stream": True}, "best_of", None),
        ({"prompt": "x", "logit_bias": {"999999": 1.0}}, "logit_bias", None),
        ({"prompt": [1, 2, 100_000]}, "prompt", None),
        ({"prompt": "x", "n": 3, "best_of": 2}, "best_of", None),
        ({"prompt": "x", "max_tokens": "four"}, "max_tokens", None),
    ],
)
async def test_a_refusal_is_a_400_and_gives_back_every_ticket(
    door: FrontDoor, tenant: Tenant, fields: dict[str, Any], param: str, code: str | None
) -> None:
    intake = intake_of(door)
    try:
        with pytest.raises(APIError) as info:
            await intake.begin(tenant, CompletionRequest, body(**fields), "req-3")
        assert info.value.status == 400, info.value.message
        assert info.value.param == param and info.value.code == code
        assert door.admission.in_flight == 0 and door.counters["requests"] == 0
    finally:
        intake.close()


async def test_a_request_admission_refuses_is_never_read(
    replica: ReplicaServer, tokenizer: Any, tenant: Tenant
) -> None:
    door = door_over(replica, tokenizer, max_in_flight=1, admission_queue=0)
    intake = intake_of(door)
    read = False

    async def reader() -> bytes:
        nonlocal read
        read = True
        return body(prompt="x")

    try:
        held = await door.admission.admit(tenant)  # the router's whole budget
        with pytest.raises(APIError) as info:
            await intake.begin(tenant, CompletionRequest, reader, "req-4")
        assert info.value.status == 429 and info.value.headers
        assert not read and door.admission.errors["overloaded"] == 1
        assert door.errors["overloaded"] == 1  # the parts' counts, summed
        door.admission.release(held)
        assert door.admission.in_flight == 0
    finally:
        intake.close()
        await door.close()
