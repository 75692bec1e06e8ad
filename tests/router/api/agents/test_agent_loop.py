"""An agent loop on two replicas: eight turns, each resending the whole history plus the
last call's result. Each turn must land where the previous turn's KV is, and find it.

The model (random ``tiny``) is made to call a tool each turn with ``tool_choice: auto`` and
a regex, so its output is the Hermes call the template renders back: the next prompt then
extends this turn's prompt and output token for token (router/api/agents/tool_template.py)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvroute.replica.serve.actor import start_replica
from kvroute.router.api.agents.tools import ToolConfig

from ....ray_session import local_ray
from ...served import MODEL, Served, serve

CONFIG = {"model": MODEL, "block_size": 16, "num_blocks": 512}
TURNS = 8
TOOL = {"type": "function", "function": {"name": "step", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}}}}  # fmt: skip


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with local_ray() as started:
        actors = [start_replica(f"al{i}", CONFIG, num_cpus=0.5, torch_threads=1) for i in (0, 1)]
        started.extend(actors)
        with serve(actors, tools=ToolConfig("hermes", auto=True)) as s:
            yield s


def literal(text: str) -> str:
    return "".join("\\" + ch if ch in "\\{}[]().*+?|^$" else ch for ch in text)


def test_each_turn_lands_on_and_hits_the_previous_turns_kv(served: Served) -> None:
    """Two conversations, their turns interleaved: each turn of each goes to the replica
    that ran its previous turn, and finds >= 90% of that turn's prompt and output cached."""
    auth = {"authorization": "Bearer key-a"}
    chats: list[list[dict[str, Any]]] = [
        [{"role": "system", "content": f"You are agent {name}. " * 8},
         {"role": "user", "content": "Count the steps."}]
        for name in ("Ada", "Bob")
    ]  # fmt: skip
    rows: list[list[tuple[str, int, int, int]]] = [[], []]
    with httpx.Client(base_url=served.url, headers=auth, timeout=120) as http:
        for turn in range(TURNS):
            for messages, seen in zip(chats, rows, strict=True):
                call = (
                    f'<tool_call>\n{{"name": "step", "arguments": {{"n": {turn}}}}}\n</tool_call>'
                )
                r = http.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": messages, "tools": [TOOL], "max_tokens": 80,
                    "structured_outputs": {"regex": literal(call)},
                })  # fmt: skip
                assert r.status_code == 200, r.text
                out = r.json()
                [tc] = out["choices"][0]["message"]["tool_calls"]
                assert json.loads(tc["function"]["arguments"]) == {"n": turn}
                usage = out["usage"]
                seen.append((r.headers["x-kvroute-replica"], usage["prompt_tokens"],
                             usage["completion_tokens"],
                             usage["prompt_tokens_details"]["cached_tokens"]))  # fmt: skip
                messages.append(out["choices"][0]["message"])
                messages.append({"role": "tool", "tool_call_id": tc["id"], "content": f"ok {turn}"})
    for seen in rows:
        # every turn where the last one ran (the goal: >= 95% of turns)
        assert len({replica for replica, *_ in seen}) == 1, rows
        for (_, prompt, output, _), (_, _, _, cached) in itertools.pairwise(seen):
            assert cached >= 0.9 * (prompt + output), rows
