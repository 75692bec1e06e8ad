"""What the front door's HTTP tests share: the model and replicas they serve, the API keys,
an official ``openai`` client, and requests that run until cancelled."""

from __future__ import annotations

from typing import Any

import openai
import ray

MODEL = "tiny"
CONFIG = {"model": MODEL, "block_size": 16, "num_blocks": 160}  # 2,560 tokens a replica
KEYS = {"key-a": "alpha", "key-b": "beta"}
# ~300 bytes = ~300 tokens of the byte-level tiny tokenizer: 18 full blocks to share.
LONG = "The quick brown fox jumps over the lazy dog while the router watches. " * 4


def client(fleet: dict[str, Any], key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet["url"] + "/v1", api_key=key, max_retries=0, timeout=60)


def running(fleet: dict[str, Any]) -> int:
    stats = ray.get([a.stats.remote() for a in fleet["actors"].values()])
    return sum(s["num_running"] + s["num_waiting"] for s in stats)


# ~8 s of decoding on an idle core (tiny: ~3 ms a token): far longer than the tests wait.
ENDLESS = {"model": MODEL, "max_tokens": 2500, "temperature": 0.0, "ignore_eos": True}
AUTH = {"Authorization": "Bearer key-a"}
