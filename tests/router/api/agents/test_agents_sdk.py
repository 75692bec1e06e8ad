"""The ``openai-agents`` SDK, unmodified, runs a tool loop against the real front door on
the random-weight ``tiny`` model, through both of its model classes: Chat Completions
(``OpenAIChatCompletionsModel``) and the Responses API (``OpenAIResponsesModel``), each
run whole (``Runner.run``) and streamed (``Runner.run_streamed``).

A random model cannot choose to call a tool, so the agent forces it (``tool_choice:
"required"``, kept on every turn) and ends the loop itself after the third call (a
``tool_use_behavior`` function): three model turns, each resending the growing history
with the tool's results. Every call's arguments reach the Python function typed, and each
turn's prompt begins with the previous one's, so its blocks are cache hits."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any, Literal

import pytest

from kvroute.replica.serve.actor import start_replica
from kvroute.router.api.agents.tools import ToolConfig

from ....ray_session import local_ray
from ...served import MODEL, Served, serve

agents = pytest.importorskip("agents", reason="openai-agents not installed")

CONFIG = {"model": MODEL, "block_size": 16, "num_blocks": 512}
TURNS = 3


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with local_ray() as started:
        actor = start_replica("ag0", CONFIG, num_cpus=0.5, torch_threads=1)
        started.append(actor)
        with serve([actor], tools=ToolConfig("hermes", auto=True)) as s:
            yield s


def run_agent(served: Served, kind: str) -> tuple[list[tuple[str, int]], Any]:
    from openai import AsyncOpenAI

    seen: list[tuple[str, int]] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Lyon"], days: int) -> str:
        """The forecast for a city, some days ahead."""
        seen.append((city, days))
        return f"{city}: sunny for {days} days"

    def after_tools(_: Any, results: list[Any]) -> Any:
        done = len(seen) >= TURNS
        return agents.ToolsToFinalOutputResult(
            is_final_output=done, final_output=results[-1].output if done else None
        )

    async def main() -> Any:
        client = AsyncOpenAI(base_url=served.url + "/v1", api_key="key-a", max_retries=0)
        model_class = (
            agents.OpenAIChatCompletionsModel
            if kind.startswith("chat")
            else agents.OpenAIResponsesModel
        )
        agent = agents.Agent(
            name="forecaster",
            instructions="Answer with the weather tool.",
            tools=[get_weather],
            model=model_class(model=MODEL, openai_client=client),
            model_settings=agents.ModelSettings(
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=200,
                temperature=1.0,
                extra_body={"seed": 3},
                include_usage=True,  # a streamed chat's usage (stream_options)
            ),
            reset_tool_choice=False,
            tool_use_behavior=after_tools,
        )
        try:
            if not kind.endswith("streamed"):
                return await agents.Runner.run(agent, "Weather in Lyon?", max_turns=TURNS + 1)
            run = agents.Runner.run_streamed(agent, "Weather in Lyon?", max_turns=TURNS + 1)
            async for _ in run.stream_events():
                pass
            return run
        finally:
            await client.close()

    agents.set_tracing_disabled(True)
    return seen, asyncio.run(main())


@pytest.mark.parametrize("kind", ["chat", "responses", "chat-streamed", "responses-streamed"])
def test_a_three_turn_tool_loop(served: Served, kind: str) -> None:
    seen, result = run_agent(served, kind)
    assert len(seen) == TURNS
    assert all(city in ("Paris", "Lyon") and isinstance(days, int) for city, days in seen)
    assert result.final_output == f"{seen[-1][0]}: sunny for {seen[-1][1]} days"
    turns = result.raw_responses
    assert len(turns) == TURNS
    inputs = [t.usage.input_tokens for t in turns]
    assert inputs == sorted(inputs) and len(set(inputs)) == TURNS  # a growing history
    for before, now in itertools.pairwise(turns):
        cached = now.usage.input_tokens_details.cached_tokens
        assert cached >= before.usage.input_tokens // 16 * 16, (kind, inputs, cached)
