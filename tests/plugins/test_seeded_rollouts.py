"""Seeded rollouts: ``rollout(..., seed=)`` / ``group(..., seed=)`` replay the same sampled tokens.

The model is the tiny random Qwen2 at temperature 1: every call samples 10 tokens from a nearly flat
distribution over 49k ids, so two calls that were not seeded alike never agree by chance. Real LangGraph
graphs and real Agents SDK runs, through the real gateway and engine.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
from agents import Agent, ModelSettings
from langchain_core.messages import AnyMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from art_core import LocalBackend, TrainableModel, Trajectory
from art_core.errors import ConfigError
from art_plugins.langgraph import trainable
from art_plugins.openai_agents import TrainableRunner

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def two_call_graph(**llm_options: Any) -> Any:
    """A drafter node and a reviser node, each one call of the trainable model (temperature 1)."""
    llm = ChatOpenAI(model="agent", base_url=f"http://127.0.0.1:9/{uuid.uuid4().hex[:8]}/v1", api_key="unused",
                     temperature=1.0, max_tokens=10, **llm_options)

    async def draft(state: State) -> dict[str, Any]:
        return {"messages": [await llm.ainvoke(state["messages"])]}

    async def revise(state: State) -> dict[str, Any]:
        return {"messages": [await llm.ainvoke([*state["messages"], ("user", "Say it again, shorter.")])]}

    builder = StateGraph(State)
    builder.add_node("draft", draft)
    builder.add_node("revise", revise)
    builder.add_edge(START, "draft")
    builder.add_edge("draft", "revise")
    builder.add_edge("revise", END)
    return builder.compile()


INPUT = {"messages": [("user", "Write a haiku about rain.")]}


def sampled(trajectory: Trajectory) -> list[list[int]]:
    """The completion ids of the trajectory's calls, in order."""
    return [call.completion_token_ids for history in trajectory.histories() for call in history.calls]


@pytest.fixture
async def model(tiny_model_dir: Path, tmp_path: Path):
    model = TrainableModel(name="agent", base_model=tiny_model_dir)
    async with LocalBackend(path=tmp_path, show_progress=False) as backend:
        await model.register(backend)
        yield model


async def test_a_seeded_graph_rollout_samples_the_same_tokens_again(model):
    agent = trainable(two_call_graph(), model)
    first, again = await agent.rollout(INPUT, seed=11), await agent.rollout(INPUT, seed=11)
    assert len(sampled(first)) == 2 and sampled(first) == sampled(again)
    other, unseeded = await agent.rollout(INPUT, seed=12), await agent.rollout(INPUT)
    assert sampled(other)[0] != sampled(first)[0] and sampled(unseeded)[0] != sampled(first)[0]
    assert sampled(first)[0] != sampled(first)[1]  # each call has its own seed, not the rollout's one


async def test_a_seeded_group_differs_within_and_replays_as_a_whole(model):
    agent = trainable(two_call_graph(), model)
    group = await agent.group(INPUT, n=3, seed=5)
    replay = await agent.group(INPUT, n=3, seed=5)
    firsts = [sampled(t)[0] for t in group.trajectories]
    assert len({tuple(ids) for ids in firsts}) == 3  # GRPO needs rollouts that differ
    assert [sampled(t) for t in group.trajectories] == [sampled(t) for t in replay.trajectories]
    neighbour = await agent.group(INPUT, n=3, seed=6)  # derived seeds: no rollout shared with seed 5's group
    assert not {tuple(sampled(t)[0]) for t in neighbour.trajectories} & {tuple(ids) for ids in firsts}


async def test_the_agents_own_seed_wins(model):
    agent = trainable(two_call_graph(seed=3), model)
    assert sampled(await agent.rollout(INPUT, seed=1)) == sampled(await agent.rollout(INPUT, seed=2))


@pytest.mark.parametrize("seed", ["1", 1.5, True])
async def test_a_seed_that_is_not_an_int_is_a_clear_error(model, seed):
    agent = trainable(two_call_graph(), model)
    with pytest.raises(ConfigError, match="seed must be an int"):
        await agent.rollout(INPUT, seed=seed)
    with pytest.raises(ConfigError, match="seed must be an int"):
        await agent.group(INPUT, n=2, seed=seed)


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
async def test_a_seeded_agents_sdk_run_samples_the_same_tokens_again(model, api):
    runner = TrainableRunner(model, api=api)
    agent = Agent(name="poet", instructions="Write a haiku.", model="agent",
                  model_settings=ModelSettings(temperature=1.0, max_tokens=10))
    (_, first), (_, again) = [await runner.run(agent, "About rain.", seed=4) for _ in range(2)]
    assert sampled(first) and sampled(first) == sampled(again)
    group = await runner.group(agent, "About rain.", n=2, seed=4)
    assert sampled(group.trajectories[0]) != sampled(group.trajectories[1])
    assert sampled((await runner.group(agent, "About rain.", n=2, seed=4)).trajectories[1]) == sampled(
        group.trajectories[1])
