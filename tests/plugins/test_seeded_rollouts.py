"""Seeded rollouts: ``rollout(..., seed=)`` / ``group(..., seed=)`` replay the same sampled tokens.

The model is the tiny random Qwen2 at temperature 1: every call samples 10 tokens from a nearly flat
distribution over 49k ids, so two calls that were not seeded alike never agree by chance. Real LangGraph
graphs and real Agents SDK runs, through the real gateway and engine.
"""

from __future__ import annotations

import pytest
from agents import Agent, ModelSettings

from art_core import Trajectory
from art_core.errors import ConfigError
from art_plugins.langgraph import trainable
from art_plugins.openai_agents import TrainableRunner
from graphs import INPUT, two_call_graph

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def sampled(trajectory: Trajectory) -> list[list[int]]:
    """The completion ids of the trajectory's calls, in order."""
    return [call.completion_token_ids for history in trajectory.histories() for call in history.calls]


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
