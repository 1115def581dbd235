"""``rollout_fn``, the method both adapters share: one input in, one scored trajectory out (what ``evaluate`` calls).

Real LangGraph and Agents SDK runs through the real gateway and engine, on the tiny random Qwen2.
"""

from __future__ import annotations

import pytest
from agents import Agent, ModelSettings

from art_core import TrainableModel
from art_core.errors import ConfigError
from art_plugins.langfuse import evaluate
from art_plugins.langgraph import trainable
from art_plugins.openai_agents import TrainableRunner
from graphs import two_call_graph

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


async def test_both_adapters_run_one_input_into_a_scored_trajectory(model: TrainableModel):
    graph = trainable(two_call_graph(max_tokens=4), model)
    runner = TrainableRunner(model)
    agent = Agent(name="Replier", instructions="Answer.", model="agent", model_settings=ModelSettings(max_tokens=4))
    for run in (graph.rollout_fn(reward=lambda trajectory, state: 0.25),
                runner.rollout_fn(reward=lambda trajectory, output: 0.25, agent=agent)):
        trajectory = await run("Hi there!")  # a string: a user message, in each framework's form
        assert trajectory.reward == 0.25
        assert [m.text() for m in trajectory.messages if m.role == "user"][0] == "Hi there!"
    trajectory = await graph.rollout_fn()({"messages": [("user", "As the graph takes it.")]})
    assert [m.text() for m in trajectory.messages if m.role == "user"][0] == "As the graph takes it."


async def test_a_missing_or_misplaced_agent_is_refused_before_anything_runs(model: TrainableModel):
    graph = trainable(two_call_graph(max_tokens=4), model)
    runner = TrainableRunner(model)
    agent = Agent(name="Replier", instructions="Answer.", model="agent")
    with pytest.raises(ConfigError, match="agent= is for a TrainableRunner"):
        graph.rollout_fn(agent=agent)
    with pytest.raises(ConfigError, match="needs agent=<the starting agent>"):
        runner.rollout_fn()
    # evaluate() says so before it reads the dataset (no Langfuse is reachable here: it would fail on that later)
    with pytest.raises(ConfigError, match="needs agent=<the starting agent>"):
        await evaluate(runner, "no-such-dataset", run_name="r", langfuse=False)
    with pytest.raises(ConfigError, match="takes a TrainableGraph or a TrainableRunner, got Agent"):
        await evaluate(agent, "no-such-dataset", run_name="r")
