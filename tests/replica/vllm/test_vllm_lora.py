"""LoRA adapters on a vLLM replica (``--engine vllm --enable-lora``): vLLM's CPU build
serves them, kvroute hands it a ``LoRARequest`` per adapter.

One replica (vLLM's AsyncLLM on ``tiny``) behind a front door in this process: a request
naming an adapter gives transformers + PEFT's greedy tokens; the router's block hashes for
it (``sha256_cbor_tagged``, the adapter's name and folder on every block) are the ones
vLLM publishes, so the index finds them; the repeat hits vLLM's cache, the base model's
same prompt does not; adapters load and unload at run time, a bad folder refused naming
``lora_path``.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from transformers import AutoTokenizer

from kvroute.replica.serve.actor import ReplicaServer
from kvroute.router.api.intake import Intake
from kvroute.router.api.openai_api import CompletionRequest
from kvroute.router.fleet.tenants import Tenant, Tenants
from kvroute.router.frontdoor import FrontDoor

from ...lora_adapters import make_adapters, peft_reference
from ...waiting import wait_until

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_adapters(tmp_path_factory.mktemp("vllm-adapters"), 2)


@pytest.fixture(scope="module")
def replica(adapters: dict[str, str]) -> Iterator[ReplicaServer]:
    config = {"engine": "vllm", "model": "tiny", "device": "cpu", "max_model_len": 2048,
              "kv_cache_memory_bytes": 64 << 20, "lora_modules": {"ad0": adapters["ad0"]},
              "engine_args": {"enable_lora": True, "max_loras": 2}}  # fmt: skip
    server = ReplicaServer("v0", config, torch_threads=1)
    try:
        yield server
    finally:
        server.shutdown()


@pytest.fixture
async def door(replica: ReplicaServer) -> AsyncIterator[FrontDoor]:
    tokenizer = AutoTokenizer.from_pretrained(replica.info().model_path)
    held = await replica.list_loras()
    door = FrontDoor([(replica, replica.info())], tokenizer=tokenizer, lora_adapters=held)
    door.fleet.subscriber.attach(asyncio.get_running_loop())
    yield door
    await door.close()


async def generate(door: FrontDoor, tenant: Tenant, model: str, prompt: list[int]) -> Any:
    """(token ids, cached prompt tokens, the router's block hashes) of one greedy request."""
    intake = Intake(door.admission, door.fleet, door.tokenizer, door.run, "tiny", door.loras)
    try:
        raw = json.dumps({"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS,
                          "temperature": 0}).encode()  # fmt: skip
        admitted = await intake.begin(tenant, CompletionRequest, raw, f"req-{random.random()}")
        [run] = admitted.runs
        d = await run.first_delta()
        ids, cached = list(d.delta_token_ids), d.num_cached_tokens
        while not d.finished:
            d = await run.next()
            ids += d.delta_token_ids
        run.close()
        return ids, cached, list(run.view.block_hashes)
    finally:
        intake.close()


async def test_an_adapter_on_vllm_is_exact_and_cached_apart(
    door: FrontDoor, adapters: dict[str, str], replica: ReplicaServer
) -> None:
    tenant = Tenants(None, "s").authenticate(None)  # no keys: every adapter
    rng = random.Random(5)
    prompt = [rng.randrange(3, 256) for _ in range(80)]  # two full 32-token blocks
    reference = peft_reference({"ad0": adapters["ad0"]}, NEW_TOKENS)
    ids, cached, hashes = await generate(door, tenant, "ad0", prompt)
    assert ids == reference("ad0", prompt) != reference(None, prompt)
    assert cached == 0 and len(hashes) == 2
    # vLLM's events name the blocks the router hashed (adapter and folder included).
    stored = door.fleet.index.counts  # stored blocks only (match counts predictions too)
    await wait_until(lambda: set(hashes) <= set(stored("v0")), 30, "the blocks indexed")
    again, cached, _ = await generate(door, tenant, "ad0", prompt)
    assert again == ids and cached == 64
    base, cached, base_hashes = await generate(door, tenant, "tiny", prompt)
    assert base == reference(None, prompt) and cached == 0
    assert set(base_hashes).isdisjoint(hashes)


async def test_adapters_load_and_unload_at_run_time(
    replica: ReplicaServer, adapters: dict[str, str], tmp_path: Any
) -> None:
    assert await replica.add_lora("ad1", adapters["ad1"]) == adapters["ad1"]
    assert await replica.list_loras() == {"ad0": adapters["ad0"], "ad1": adapters["ad1"]}
    with pytest.raises(ValueError, match="lora_path"):
        await replica.add_lora("bad", str(tmp_path))
    assert await replica.remove_lora("ad1") is True
    assert await replica.remove_lora("ad1") is False
    assert set(await replica.list_loras()) == {"ad0"}
