"""MLflow traces of rollouts (``art_plugins.mlflow``): a real LangGraph graph's rollouts through the real gateway
become traces on a real ``mlflow server``; the step attaches each reward as feedback and links the traces to the
model's run. Read back through ``MlflowClient``."""

from __future__ import annotations

import json

import pytest
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph
from mlflow import MlflowClient

from art_core import LocalBackend, TrainableModel, TrainConfig
from art_core.tracking import MLflowTracker
from art_plugins.langgraph import trainable
from art_plugins.mlflow import MLflowTracing

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


def one_call_graph():
    # The base URL is never reached: trainable() routes the calls for the model to its gateway.
    llm = ChatOpenAI(model="traced", base_url="http://127.0.0.1:9/unused/v1", api_key="unused", temperature=1.0,
                     max_tokens=8)

    async def answer(state: MessagesState) -> dict:
        return {"messages": [await llm.ainvoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("answer", answer)
    builder.add_edge(START, "answer")
    builder.add_edge("answer", END)
    return builder.compile()


def reward(trajectory, state) -> float:
    text = str(state["messages"][-1].content)
    trajectory.metrics["length"] = float(len(text))
    return len(text) / 100


async def test_each_rollout_is_a_trace_with_its_reward_as_feedback_linked_to_the_steps_run(
        tiny_model_dir, tmp_path, monkeypatch, mlflow_server):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)  # where MLflow exports traces and feedback
    model = TrainableModel(name="traced", project="traces", base_model=tiny_model_dir,
                           report_to=MLflowTracker(tracking_uri=mlflow_server))
    tracing = MLflowTracing()
    async with LocalBackend(path=tmp_path, show_progress=False) as backend:
        await model.register(backend)
        agent = trainable(one_call_graph(), model)
        with tracing.tracing():
            group = await agent.group({"messages": [("user", "Name a color.")]}, n=4, reward=reward, seed=0)
        untraced = await agent.group({"messages": [("user", "Name a color.")]}, n=2, reward=reward, seed=1)
        await model.train([group], config=TrainConfig(learning_rate=1e-3))
        await model.finish_tracking()
    assert tracing.failures == 0 and model.tracking.failures == 0
    assert all("mlflow_trace_id" not in t.metadata for t in untraced.trajectories)  # outside tracing(): none

    client = MlflowClient(tracking_uri=mlflow_server)
    run_id = json.loads((tmp_path / "traces" / "models" / "traced" / "tracking" / "runs.json").read_text())["mlflow"]
    experiment = client.get_experiment_by_name("traces")
    traces = client.search_traces(locations=[experiment.experiment_id], run_id=run_id)
    by_id = {t.info.trace_id: t for t in traces}
    assert set(by_id) == {t.metadata["mlflow_trace_id"] for t in group.trajectories}  # each rollout, linked

    for trajectory in group.trajectories:
        trace = by_id[trajectory.metadata["mlflow_trace_id"]]
        assert trace.info.tags["art.trajectory_id"] == trajectory.id
        assert trace.info.tags["art.sampled_step"] == "0"
        feedback = {a.name: a.value for a in trace.info.assessments}
        assert feedback["reward"] == pytest.approx(trajectory.reward)
        assert feedback["length"] == trajectory.metrics["length"]
        root, *calls = trace.data.spans
        assert root.name == "langgraph rollout" and root.inputs["messages"]
        (call,) = calls  # the graph's one call to the model, as the gateway answered it
        assert call.span_type == "LLM" and call.parent_id == root.span_id
        assert call.attributes["request_id"] == trajectory.calls[0].request_id
        assert call.attributes["completion_tokens"] == len(trajectory.calls[0].completion_token_ids)


async def test_a_streamed_agents_sdk_run_is_a_trace_whose_call_span_gets_its_token_count(
        tiny_model_dir, tmp_path, monkeypatch, mlflow_server):
    from agents import Agent, ModelSettings

    from art_core import TrajectoryGroup
    from art_plugins.openai_agents import TrainableRunner

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    model = TrainableModel(name="agent", project="agent-traces", base_model=tiny_model_dir,
                           report_to=MLflowTracker(tracking_uri=mlflow_server))
    tracing = MLflowTracing()
    async with LocalBackend(path=tmp_path, show_progress=False) as backend:
        await model.register(backend)
        runner = TrainableRunner(model)
        replier = Agent(name="Replier", instructions="Answer.", model="agent",
                        model_settings=ModelSettings(max_tokens=4))
        with tracing.tracing():
            streamed = runner.run_streamed(replier, "Hi!", reward=lambda trajectory, output: 0.5)
        _, trajectory = await streamed.wait()  # the run outlives the scope: its trace ends with its events
        with pytest.warns(UserWarning):  # one rollout: nothing to learn, but the step is still reported
            await model.train([TrajectoryGroup([trajectory])], config=TrainConfig(learning_rate=1e-3))
        await model.finish_tracking()
    assert tracing.failures == 0 and model.tracking.failures == 0

    client = MlflowClient(tracking_uri=mlflow_server)
    run_id = json.loads((tmp_path / "agent-traces" / "models" / "agent" / "tracking" / "runs.json").read_text())["mlflow"]
    (trace,) = client.search_traces(locations=[client.get_experiment_by_name("agent-traces").experiment_id],
                                    run_id=run_id)
    assert trace.info.trace_id == trajectory.metadata["mlflow_trace_id"]
    assert {a.name: a.value for a in trace.info.assessments}["reward"] == 0.5
    root, *calls = trace.data.spans
    assert root.name == "openai-agents rollout" and root.inputs == "Hi!"
    assert [c.attributes["completion_tokens"] for c in calls] == [len(c.completion_token_ids) for c in trajectory.calls]
