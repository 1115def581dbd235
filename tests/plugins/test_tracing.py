"""The tracer interface (``art_plugins._tracing``): what a rollout scope tells each tracer, in what order.

``Recorder`` is a tracer that writes down what it is told: a second implementation of the interface beside
Langfuse's (``test_langfuse.py`` checks that one against a Langfuse stand-in). Real LangGraph graphs and a real
Agents SDK streamed run, through the real gateway and engine, on the tiny random Qwen2 (what it says does not
matter here, only that it is called).
"""

from __future__ import annotations

from typing import Any

import pytest
from agents import Agent, ModelSettings
from langchain_core.callbacks import BaseCallbackHandler

from art_core import TrainableModel, Trajectory
from art_plugins._tracing import RolloutInfo, RoutedCall, tracing_rollouts
from art_plugins.langgraph import trainable
from art_plugins.openai_agents import TrainableRunner
from graphs import INPUT, two_call_graph

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class ChatEvents(BaseCallbackHandler):
    """Notes when a chat model call starts and ends, inline (in the task making the call)."""

    run_inline = True

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def on_chat_model_start(self, serialized: Any, messages: Any, **kwargs: Any) -> None:
        self.events.append("llm start")

    def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        self.events.append("llm end")


class Observed:
    """What one rollout's scope told the recorder."""

    def __init__(self, info: RolloutInfo) -> None:
        self.info = info
        self.events: list[Any] = ["start"]
        self.calls: list[RoutedCall] = []
        self.completions: dict[str | None, int | None] = {}

    def enter(self) -> None:
        self.events.append("enter")

    def exit(self, error: BaseException | None) -> None:
        self.events.append(("exit", error))

    def end(self) -> None:
        self.events.append("end")

    def langchain_callbacks(self) -> list[Any]:
        self.events.append("callbacks")
        return [ChatEvents(self.events)]

    def on_call(self, call: RoutedCall) -> None:
        self.events.append(("call", call.completion_tokens is None))  # True: a live stream, counted later
        self.calls.append(call)
        call.when_complete(lambda count: self.completions.__setitem__(call.request_id, count))

    def link(self, trajectory: Trajectory) -> None:
        self.events.append(("link", trajectory.id, trajectory.reward))

    def finish(self, trajectory: Trajectory) -> None:
        self.events.append(("finish", trajectory.id, trajectory.reward))


class Recorder:
    """A tracer that records what rollout scopes tell it (one ``Observed`` per rollout)."""

    def __init__(self) -> None:
        self.rollouts: list[Observed] = []

    def start_rollout(self, info: RolloutInfo) -> Observed:
        self.rollouts.append(Observed(info))
        return self.rollouts[-1]


def assert_calls_match_the_records(model: TrainableModel, observed: Observed, calls: int) -> None:
    """Each routed call told to the tracer is one gateway record, with its step and token counts."""
    records = {r.request_id: r for r in model.rollout_records(observed.info.rollout_id)}
    assert sorted(c.request_id for c in observed.calls) == sorted(records) and len(records) == calls
    for call in observed.calls:
        record = records[call.request_id]
        assert (call.adapter_step, call.prompt_tokens) == (record.adapter_step, len(record.prompt_token_ids))
        assert observed.completions[call.request_id] == call.completion_tokens == len(record.completion_token_ids)


@pytest.mark.parametrize("streaming", [False, True])
async def test_every_tracer_is_told_the_rollout_in_order(model: TrainableModel, streaming: bool):
    first, second = Recorder(), Recorder()
    agent = trainable(two_call_graph(streaming=streaming, max_tokens=4), model)
    with tracing_rollouts(first, second):  # two tracers at once, as Langfuse and MLflow would be
        group = await agent.group(INPUT, n=2, reward=lambda trajectory, state: 0.5)
    assert len(group) == 2 and not group.exceptions
    assert len(first.rollouts) == len(second.rollouts) == 2
    for recorder in (first, second):
        for observed, trajectory in zip(recorder.rollouts, sorted(
                group, key=lambda t: [o.info.trajectory_id for o in recorder.rollouts].index(t.id)), strict=True):
            info = observed.info
            assert (info.framework, info.input, info.model) == ("langgraph", INPUT, model)
            assert (info.rollout_id, info.trajectory_id) == (trajectory.metadata["rollout_id"], trajectory.id)
            call = ("call", streaming)  # a live stream's headers carry no completion count: it comes at the body's end
            assert observed.events == [
                "start", "enter", "callbacks",
                "llm start", call, "llm end", "llm start", call, "llm end",  # each call while its LLM run is open
                ("exit", None), "end", ("link", trajectory.id, 0.0), ("finish", trajectory.id, 0.5)]
            assert_calls_match_the_records(model, observed, 2)
    group_ids = {o.info.group_id for o in first.rollouts}
    assert len(group_ids) == 1 and None not in group_ids  # the group's rollouts share its id


async def test_rollouts_outside_tracing_are_told_to_no_one(model: TrainableModel):
    recorder = Recorder()
    agent = trainable(two_call_graph(max_tokens=4), model)
    with tracing_rollouts(recorder):
        pass
    await agent.rollout(INPUT)
    with tracing_rollouts(recorder):
        with agent.capture() as run:  # a run driven by hand is not traced: its input and config are the caller's
            await agent.graph.ainvoke(INPUT)
    run.trajectory()
    assert recorder.rollouts == []


async def test_a_streamed_agents_run_ends_its_trace_when_its_events_end(model: TrainableModel):
    recorder = Recorder()
    runner = TrainableRunner(model)
    replier = Agent(name="Replier", instructions="Answer.", model="agent", model_settings=ModelSettings(max_tokens=4))
    with tracing_rollouts(recorder):
        streamed = runner.run_streamed(replier, "Hi!", reward=lambda trajectory, output: 1.0)
    (observed,) = recorder.rollouts
    # The run's task goes on after run_streamed returns: the scope was left, the trace is not ended yet.
    assert observed.events == ["start", "enter", ("exit", None)]
    assert observed.info.framework == "openai-agents" and observed.info.input == "Hi!"
    _, trajectory = await streamed.wait()
    assert observed.events[-3:] == ["end", ("link", trajectory.id, 0.0), ("finish", trajectory.id, 1.0)]
    assert observed.events[3] == ("call", True)  # a live stream, told in the run's task after the scope was left
    assert_calls_match_the_records(model, observed, 1)
