"""Langfuse, end to end: real LangGraph and Agents SDK groups traced through the real ``langfuse`` SDK.

The SDK sends to ``tests/langfuse_receiver.py``, a local server standing in for Langfuse (a real Langfuse
server cannot run on this machine), which decodes the OTLP protobuf and keeps the score batches. The
trainable model is a tiny Qwen2 fitted to this module's script (``tests/scripted_model.py``), served by the
real gateway and engine; RULER judges through the same gateway, its JSON held to the schema by the gateway's
constrained decoding.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from agents import Agent, ModelSettings
from agents.handoffs import Handoff
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI
from langfuse import Langfuse
from langgraph.prebuilt import create_react_agent
from langfuse_receiver import PROJECT_ID, Receiver
from opentelemetry.sdk.trace import TracerProvider

from art_core import LocalBackend, TrainableModel, ruler_score_group, score_group
from art_plugins import _langfuse_options
from art_plugins.langfuse import LangfuseTracing, current_dataset_item, evaluate
from art_plugins.langgraph import trainable
from art_plugins.openai_agents import TrainableRunner
from scripted_model import call, fit_scripted_model, say, tool_result

pytestmark = [pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:create_react_agent:DeprecationWarning")]

MODEL = "agent"
SYSTEM = "You are a calculator. Use the tools."
QUESTION = "What is 3 + 4?"
SETTINGS = ModelSettings(temperature=0, max_tokens=48)


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def react_graph(*, streaming: bool = False) -> Any:
    llm = ChatOpenAI(model=MODEL, base_url=f"http://127.0.0.1:9/{uuid.uuid4().hex[:8]}/v1", api_key="unused",
                     temperature=0.0, max_tokens=48, streaming=streaming)
    return create_react_agent(llm, [add], prompt=SYSTEM)


def spanish_desk() -> Agent[Any]:
    spanish = Agent(name="Spanish", instructions="Answer in Spanish.", model=MODEL, model_settings=SETTINGS)
    return Agent(name="Triage", instructions="Hand Spanish questions to the Spanish agent.", handoffs=[spanish],
                 model=MODEL, model_settings=SETTINGS)


def script() -> list[Any]:
    def ask(system: str, question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": system}, {"role": "user", "content": question}]

    transfer = Handoff.default_tool_name(spanish_desk().handoffs[0])  # type: ignore[arg-type]
    schema = {"additionalProperties": False, "type": "object", "properties": {}, "required": []}
    triage_tools = [{"type": "function", "function": {
        "name": transfer, "parameters": schema, "strict": True,
        "description": "Handoff to the Spanish agent to handle the request. "}}]
    handed_over = [call(transfer), tool_result(json.dumps({"assistant": "Spanish"}))]
    spanish_question = "¿Cuánto es 2 + 2?"
    return [
        ([*ask(SYSTEM, QUESTION), call("add", a=3, b=4), tool_result("7"), say("3 + 4 = 7.")],
         [convert_to_openai_tool(add)]),
        ([*ask("Hand Spanish questions to the Spanish agent.", spanish_question), *handed_over], triage_tools),
        ([*ask("Answer in Spanish.", spanish_question), *handed_over, say("Son 4.")], []),
    ]


# --- fixtures: one receiver, one client, one backend for the module ------------------------------------


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    receiver = Receiver().start()
    yield receiver
    receiver.close()


def langfuse_client(base_url: str, **options: Any) -> Langfuse:
    """A real SDK client of its own (a fresh public key: the SDK keeps one client per key)."""
    return Langfuse(public_key=f"pk-lf-{uuid.uuid4().hex[:8]}", secret_key="sk-lf-test", base_url=base_url,
                    tracer_provider=TracerProvider(shutdown_on_exit=False), flush_interval=0.2, **options)


@pytest.fixture(scope="module")
def scripted_dir(smollm2_dir: Path) -> Path:
    return fit_scripted_model(smollm2_dir, script())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def model(scripted_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TrainableModel]:
    model = TrainableModel(name=MODEL, project="langfuse", base_model=scripted_dir)
    async with LocalBackend(path=tmp_path_factory.mktemp("art"), show_progress=False) as backend:
        await model.register(backend)
        yield model


@pytest_asyncio.fixture(scope="module", loop_scope="module", autouse=True)
async def _close_the_default_tracing() -> AsyncIterator[None]:
    """``langfuse=True`` keeps one tracing per process; close it with the module."""
    yield
    if _langfuse_options.OPTIONS.default is not None:
        await _langfuse_options.OPTIONS.default.aclose(timeout=2.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tracing(receiver: Receiver) -> AsyncIterator[LangfuseTracing]:
    tracing = LangfuseTracing(langfuse_client(receiver.url), flush_timeout=5.0)
    yield tracing
    await tracing.aclose()


def ancestors(span: Any, by_id: dict[str, Any]) -> list[Any]:
    found = []
    while span.parent_id in by_id:
        span = by_id[span.parent_id]
        found.append(span)
    return found


def llm_spans(spans: list[Any]) -> list[Any]:
    return [s for s in spans if s.attributes.get("langfuse.observation.type") == "generation"
            or s.attributes.get("openinference.span.kind") == "LLM"]


def assert_calls_carry_the_gateway_facts(step: int, trajectory: Any, spans: list[Any]) -> None:
    """Each trainable call is one LLM observation carrying its rollout id, adapter step and token counts."""
    calls = [c for h in trajectory.histories() for c in h.calls]
    llms = llm_spans(spans)
    assert sorted(s.metadata("request_id") for s in llms) == sorted(c.request_id for c in calls)
    by_request = {c.request_id: c for c in calls}
    for span in llms:
        call_record = by_request[span.metadata("request_id")]
        assert span.metadata("rollout_id") == trajectory.metadata["rollout_id"] == call_record.rollout_id
        assert span.metadata("adapter_step") == call_record.adapter_step == step
        assert span.metadata("prompt_tokens") == len(call_record.prompt_token_ids)
        assert span.metadata("completion_tokens") == len(call_record.completion_token_ids)
        assert json.loads(span.attributes["langfuse.observation.usage_details"])["output"] == len(
            call_record.completion_token_ids)


# --- the tests -----------------------------------------------------------------------------------------


async def test_off_sends_nothing_and_imports_nothing(model: TrainableModel, receiver: Receiver):
    # A fresh interpreter: the adapters do not import the Langfuse layer (nor the SDK) unless asked.
    import subprocess
    import sys

    code = ("import sys, art_plugins.langgraph, art_plugins.openai_agents; "
            "print(any(m == 'langfuse' or m.startswith(('langfuse.', 'art_plugins.langfuse')) for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.strip() == "False"
    before = len(receiver.requests)
    trajectory = await trainable(react_graph(), model).rollout({"messages": [("user", QUESTION)]})
    assert "langfuse_trace_id" not in trajectory.metadata and len(receiver.requests) == before


async def test_langgraph_group_scored_and_trained(model: TrainableModel, receiver: Receiver, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    # langfuse=True: the client comes from the standard environment variables.
    public_key = f"pk-lf-{uuid.uuid4().hex[:8]}"
    for key, value in {"LANGFUSE_PUBLIC_KEY": public_key, "LANGFUSE_SECRET_KEY": "sk-lf-test",
                       "LANGFUSE_BASE_URL": receiver.url, "LANGFUSE_FLUSH_INTERVAL": "0.2"}.items():
        monkeypatch.setenv(key, value)
    agent = trainable(react_graph(), model, langfuse=True)
    order = itertools.count()
    group = await agent.group({"messages": [("user", QUESTION)]}, n=2,
                              reward=lambda t, state: float(next(order)))  # 0 and 1: a group worth a step
    assert len(group) == 2 and not group.exceptions
    trace_ids = [t.metadata["langfuse_trace_id"] for t in group]
    assert trace_ids == [Langfuse.create_trace_id(seed=t.id) for t in group] and len(set(trace_ids)) == 2

    # a custom component and RULER (the same gateway as judge, JSON by constrained decoding)
    judge = functools.partial(ruler_score_group, judge=f"openai/{MODEL}", api_base=model.base_url, api_key="local",
                              explanation_max_chars=40, cache_dir=tmp_path / "ruler",
                              completion_kwargs={"temperature": 0, "max_tokens": 200})
    scored = await score_group(group, {"says_seven": lambda t, state: float("7" in t.messages[-1].text())},
                               ruler=judge, weights={"says_seven": 0.5, "ruler": 0.5})
    assert scored is not None and all(t.metadata["langfuse_trace_id"] for t in scored)
    step_before = model.step
    metrics = await model.train([scored])
    tracing = _langfuse_options.OPTIONS.default
    assert tracing is not None and tracing.public_key == public_key

    assert receiver.wait_for(lambda r: len(r.scores_for(trace_ids[1])) == 3 and any(
        s.name == "training-step" for s in r.spans))
    for trajectory in scored:
        trace_id = trajectory.metadata["langfuse_trace_id"]
        spans = receiver.trace(trace_id)
        names = [s.name for s in spans]
        # the rollout's root, LangGraph's structure under it (graph, nodes, the LLM call, the tool)
        (root,) = [s for s in spans if s.name == "rollout"]
        # the trace's root: its parent is the SDK's stand-in for the seeded trace id, exported by no one
        assert root.attributes["langfuse.internal.as_root"] is True and root.parent_id not in {s.span_id for s in spans}
        assert root.attributes["langfuse.trace.name"] == "rollout"
        assert root.attributes["session.id"] == "langfuse/agent"
        assert {k: root.trace_metadata(k) for k in ("model", "step", "framework", "task")} == {
            "model": "agent", "step": str(step_before), "framework": "langgraph", "task": QUESTION}
        assert root.trace_metadata("group") and root.trace_metadata("rollout_id") == trajectory.metadata["rollout_id"]
        graph = next(s for s in spans if s.name == "LangGraph")
        assert graph.parent_id == root.span_id
        assert {"agent", "tools", "add", "ChatOpenAI"} <= set(names)
        tool_span = next(s for s in spans if s.name == "add")
        assert tool_span.attributes["langfuse.observation.type"] == "tool"
        assert all(s.attributes.get("session.id") == "langfuse/agent" for s in spans)  # propagated to every span
        assert_calls_carry_the_gateway_facts(step_before, trajectory, spans)
        # scores: the reward, the custom component by name, RULER with its explanation
        scores = receiver.scores_for(trace_id)
        assert scores["reward"]["value"] == pytest.approx(trajectory.reward)
        assert scores["says_seven"]["value"] == trajectory.metrics["says_seven"] == 1.0
        assert scores["ruler"]["value"] == pytest.approx(trajectory.metrics["ruler_score"])
        assert scores["ruler"]["comment"].startswith("RULER (openai/agent")
    # the step: a trace of its own listing the trajectories, history.jsonl too, best/worst printed
    (step_span,) = [s for s in receiver.spans if s.name == "training-step"]
    assert step_span.attributes["langfuse.trace.name"] == "training-step"
    assert sorted(step_span.metadata("trajectory_trace_ids")) == sorted(trace_ids)
    assert json.loads(step_span.attributes["langfuse.observation.output"])["reward_mean"] == metrics["reward_mean"]
    history = await model.history()
    assert sorted(history[-1]["langfuse_trace_ids"]) == sorted(trace_ids)
    printed = capsys.readouterr().out
    best = max(scored, key=lambda t: t.reward).metadata["langfuse_trace_id"]
    worst = min(scored, key=lambda t: t.reward).metadata["langfuse_trace_id"]
    assert f"{receiver.url}/project/{PROJECT_ID}/traces/{best}" in printed.split("best")[1].splitlines()[0]
    assert f"{receiver.url}/project/{PROJECT_ID}/traces/{worst}" in printed.split("worst")[1].splitlines()[0]
    assert receiver.gzip_bodies > 0  # the SDK's default: gzip-compressed OTLP


async def test_agents_group_with_handoff(model: TrainableModel, receiver: Receiver, tracing: LangfuseTracing,
                                        tmp_path: Path):
    runner = TrainableRunner(model, langfuse=tracing)
    step = model.step
    flip = itertools.cycle([0.0, 1.0])
    group = await runner.group(spanish_desk(), "¿Cuánto es 2 + 2?", n=2, reward=lambda t, output: next(flip))
    assert len(group) == 2 and not group.exceptions
    assert all(len(t.additional_histories) == 1 for t in group)  # the handoff gave the Spanish agent a history
    judge = functools.partial(ruler_score_group, judge=f"openai/{MODEL}", api_base=model.base_url, api_key="local",
                              explanation_max_chars=40, cache_dir=tmp_path / "ruler",
                              completion_kwargs={"temperature": 0, "max_tokens": 200})
    group = await score_group(group, {"answered": lambda t, output: float(output == "Son 4.")}, ruler=judge)
    assert group is not None
    await model.train([group])  # the step sends the final scores
    assert await tracing.flush()
    for trajectory in group:
        trace_id = trajectory.metadata["langfuse_trace_id"]
        assert trace_id == Langfuse.create_trace_id(seed=trajectory.id)
        assert receiver.wait_for(lambda r: "reward" in r.scores_for(trace_id))
        spans = receiver.trace(trace_id)
        by_id = {s.span_id: s for s in spans}
        (root,) = [s for s in spans if s.name == "rollout"]
        assert root.trace_metadata("framework") == "openai-agents"
        # OpenInference's trace of the run nests under the rollout: workflow, agents, turns, LLM calls, handoff
        workflow = next(s for s in spans if s.name == "Agent workflow" and s.parent_id == root.span_id)
        assert workflow.scope.startswith("openinference")
        agents = {s.name: s for s in spans if s.attributes.get("openinference.span.kind") == "AGENT"
                  and s.name in ("Triage", "Spanish")}
        assert set(agents) == {"Triage", "Spanish"}
        handoff = next(s for s in spans if "handoff" in s.name.lower())
        assert (handoff.attributes.get("input.value"), handoff.attributes.get("output.value")) == ("Triage", "Spanish")
        # each agent's LLM call sits under that agent, and carries the gateway's facts
        llms = llm_spans(spans)
        assert len(llms) == 2
        callers = sorted(next(a.name for a in ancestors(s, by_id) if a.name in agents) for s in llms)
        assert callers == ["Spanish", "Triage"]
        assert all(root in ancestors(s, by_id) for s in spans if s is not root)
        assert_calls_carry_the_gateway_facts(step, trajectory, spans)
        assert receiver.wait_for(lambda r: len(r.scores_for(trace_id)) == 3)
        scores = receiver.scores_for(trace_id)
        assert scores["reward"]["value"] == pytest.approx(trajectory.reward)
        assert scores["answered"]["value"] == trajectory.metrics["answered"] == 1.0
        assert scores["ruler"]["value"] == pytest.approx(trajectory.metrics["ruler_score"])
        assert scores["ruler"]["comment"].startswith("RULER (openai/agent")


async def test_agents_run_streamed_is_traced(model: TrainableModel, receiver: Receiver, tracing: LangfuseTracing):
    # run_streamed: one trace per run like run, closed when the events end; its calls are live streams, whose
    # response headers leave before any token is sampled, yet each generation carries its completion count.
    runner = TrainableRunner(model, langfuse=tracing)
    step = model.step
    streamed = runner.run_streamed(spanish_desk(), "¿Cuánto es 2 + 2?", reward=lambda t, output: 1.0)
    kinds = [event.type async for event in streamed.stream_events()]
    assert "raw_response_event" in kinds  # token deltas arrived as events
    result, trajectory = await streamed.wait()
    assert result.final_output == "Son 4." and len(trajectory.additional_histories) == 1
    records = model.rollout_records(trajectory.metadata["rollout_id"])
    assert len(records) == 2 and all(r.request.get("stream") for r in records)  # live streams, both calls
    trace_id = trajectory.metadata["langfuse_trace_id"]
    assert trace_id == Langfuse.create_trace_id(seed=trajectory.id)
    assert await tracing.flush()
    assert receiver.wait_for(lambda r: "reward" in r.scores_for(trace_id))
    assert receiver.scores_for(trace_id)["reward"]["value"] == 1.0
    spans = receiver.trace(trace_id)
    by_id = {s.span_id: s for s in spans}
    (root,) = [s for s in spans if s.name == "rollout"]
    assert root.trace_metadata("framework") == "openai-agents" and root.attributes["session.id"] == "langfuse/agent"
    assert any(s.name == "Agent workflow" and s.parent_id == root.span_id for s in spans)
    assert all(root in ancestors(s, by_id) for s in spans if s is not root)
    assert len(llm_spans(spans)) == 2
    assert_calls_carry_the_gateway_facts(step, trajectory, spans)


async def test_streamed_langgraph_calls_carry_completion_tokens(model: TrainableModel, receiver: Receiver,
                                                                tracing: LangfuseTracing):
    # ChatOpenAI(streaming=True): the redirected client reads a live stream; the count comes from the record.
    agent = trainable(react_graph(streaming=True), model, langfuse=tracing)
    trajectory = await agent.rollout({"messages": [("user", QUESTION)]})
    assert trajectory.messages[-1].text() == "3 + 4 = 7."
    records = model.rollout_records(trajectory.metadata["rollout_id"])
    assert len(records) == 2 and all(r.request.get("stream") for r in records)  # live streams, both calls
    assert await tracing.flush()
    trace_id = trajectory.metadata["langfuse_trace_id"]
    assert receiver.wait_for(lambda r: len(llm_spans(r.trace(trace_id))) == 2)
    assert_calls_carry_the_gateway_facts(model.step, trajectory, receiver.trace(trace_id))


async def test_dataset_runs_before_and_after_training(model: TrainableModel, receiver: Receiver,
                                                      tracing: LangfuseTracing):
    receiver.add_dataset("sums", [{"input": QUESTION, "expected_output": "7"},
                                  {"input": QUESTION, "expected_output": "8"}])
    agent = trainable(react_graph(), model, langfuse=tracing)

    def correct(trajectory: Any, state: Any) -> float:
        return float(current_dataset_item().expected_output in trajectory.messages[-1].text())

    runs = []
    for run_name in ("before", "after"):
        run = await evaluate(agent, "sums", run_name=run_name, reward=correct)
        assert run.failures == [] and len(run.trajectories) == 2
        assert sorted(run.trajectories.rewards) == [0.0, 1.0]  # "3 + 4 = 7." matches one expected output
        assert run.url and run.experiment_id and run.url.endswith(run.experiment_id)
        runs.append(run)
        if run_name == "before":
            order = itertools.count()
            group = await agent.group({"messages": [("user", QUESTION)]}, n=2, reward=lambda t, s: float(next(order)))
            await model.train([group])
    assert runs[0].experiment_id != runs[1].experiment_id
    assert receiver.run_items == []  # the v5 SDK links items through the spans' experiment attributes
    assert await tracing.flush()
    for run in runs:
        for trajectory in run.trajectories:
            trace_id = trajectory.metadata["langfuse_trace_id"]
            item_id = trajectory.metadata["langfuse_dataset_item_id"]
            assert receiver.wait_for(lambda r: "reward" in r.scores_for(trace_id))
            spans = receiver.trace(trace_id)
            # Langfuse's experiment runner opened the trace and linked the item; the rollout is inside it
            item_run = next(s for s in spans if s.name == "experiment-item-run")
            assert item_run.attributes["langfuse.experiment.dataset.id"] == "ds-sums"
            assert item_run.attributes["langfuse.experiment.item.id"] == item_id
            assert item_run.attributes["langfuse.experiment.id"] == run.experiment_id
            rollout = next(s for s in spans if s.name == "rollout")
            assert rollout.attributes["langfuse.experiment.item.id"] == item_id
            assert any(s.name == "LangGraph" and s.parent_id == rollout.span_id for s in spans)
            assert_calls_carry_the_gateway_facts_for_step(trajectory, spans)
            score = receiver.scores_for(trace_id)["reward"]
            assert score["value"] == trajectory.reward and score["observationId"]
    steps = [[s.metadata("adapter_step") for s in llm_spans(receiver.trace(t.metadata["langfuse_trace_id"]))]
             for run in runs for t in run.trajectories]
    assert {x for r in steps[:2] for x in r} == {runs_step := steps[0][0]} and all(
        x == runs_step + 1 for r in steps[2:] for x in r)


def assert_calls_carry_the_gateway_facts_for_step(trajectory: Any, spans: list[Any]) -> None:
    calls = [c for h in trajectory.histories() for c in h.calls]
    assert sorted(s.metadata("adapter_step") for s in llm_spans(spans)) == sorted(c.adapter_step for c in calls)


@pytest.mark.parametrize("mode", ["down", "error", "hang"])
async def test_a_failing_langfuse_never_holds_up_training(model: TrainableModel, mode: str,
                                                          caplog: pytest.LogCaptureFixture):
    bad = Receiver(mode=mode).start()
    if mode == "down":
        bad.close()  # nothing listens there any more
    try:
        tracing = LangfuseTracing(langfuse_client(bad.url, timeout=1), flush_timeout=1.0)
        agent = trainable(react_graph(), model, langfuse=tracing)
        order = itertools.count()
        # In "hang" mode the receiver answers nothing until ``bad.close()`` below: rollouts or a step that waited
        # for Langfuse would hang here (until pytest's timeout fails the test), whatever the machine's speed.
        started = time.monotonic()
        group = await agent.group({"messages": [("user", QUESTION)]}, n=2, reward=lambda t, s: float(next(order)))
        rollouts = time.monotonic() - started
        assert len(group) == 2 and not group.exceptions
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="art_plugins.langfuse"):
            await model.train([group])
        print(f"{mode}: rollouts {rollouts:.2f} s, step {time.monotonic() - started:.2f} s")
        reports = [r.getMessage() for r in caplog.records if r.name == "art_plugins.langfuse"]
        assert len(reports) == 1 and "export failure" in reports[0], reports
        count, _ = tracing.failure_report()
        assert count >= 1
        await tracing.aclose(timeout=1.0)
    finally:
        bad.close()


def _scored_trace(client: Langfuse, name: str) -> str:
    with client.start_as_current_observation(name=name) as span:
        trace_id = span.trace_id
    client.create_score(name=name, value=1.0, trace_id=trace_id)  # scores go through the client's own threads
    client.flush()
    return str(trace_id)


async def test_closing_a_tracing_silences_no_client(receiver: Receiver, monkeypatch: pytest.MonkeyPatch):
    """``aclose`` flushes and never shuts a client down: the SDK shares one set of exporters per public key, so
    the caller's own client, and a second run's tracing made from the same environment, keep sending scores."""
    client = langfuse_client(receiver.url)
    await LangfuseTracing(client, flush_timeout=5.0).aclose()
    trace_id = _scored_trace(client, "after-training")
    assert receiver.wait_for(lambda r: "after-training" in r.scores_for(trace_id), timeout=60), \
        "the user's client stopped sending scores after aclose"
    client.shutdown()

    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", f"pk-lf-{uuid.uuid4().hex[:8]}")  # what langfuse=True reads
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", "sk-lf-test")
    monkeypatch.setenv("LANGFUSE_BASE_URL", receiver.url)
    await LangfuseTracing(flush_timeout=5.0).aclose()  # a first run in this process (a notebook, a sweep)
    second = LangfuseTracing(flush_timeout=5.0)
    trace_id = _scored_trace(second.client, "second-run")
    assert receiver.wait_for(lambda r: "second-run" in r.scores_for(trace_id), timeout=60), \
        "a second run's tracing sent no scores after the first one closed"
    await second.aclose()


def test_langfuse_true_samples_at_langfuse_sample_rate(monkeypatch: pytest.MonkeyPatch):
    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", f"pk-lf-{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", "sk-lf-test")
    monkeypatch.setenv("LANGFUSE_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("LANGFUSE_SAMPLE_RATE", "0.25")
    sampler = LangfuseTracing().tracer_provider.sampler  # the provider made for langfuse=True, as the SDK's would be
    assert isinstance(sampler, TraceIdRatioBased) and sampler.rate == 0.25


async def test_a_rescored_reward_does_not_carry_the_rollout_reward_functions_error():
    from art_core import Trajectory, TrajectoryGroup
    from art_plugins._langfuse_traces import reward_scores

    trajectory = Trajectory(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "7"}],
                            metadata={"reward_error": "ValueError: blew up"})
    assert reward_scores(trajectory)[0] == ("reward", 0.0, "reward function raised ValueError: blew up")
    rescored = await score_group(TrajectoryGroup([trajectory]), {"says_seven": lambda t, s: 1.0})
    assert reward_scores(rescored.trajectories[0])[0] == ("reward", 1.0, None)


async def test_a_masking_client_masks_the_task_text_on_the_trace_too(receiver: Receiver):
    """The rollout's task (the user's words) is a trace attribute, which the SDK does not mask: it is masked here."""
    from art_plugins._tracing import RolloutInfo

    def mask(*, data: Any, **_: Any) -> Any:  # every string, however deep
        if isinstance(data, dict):
            return {key: mask(data=value) for key, value in data.items()}
        if isinstance(data, list | tuple):
            return [mask(data=value) for value in data]
        return "MASKED" if isinstance(data, str) else data

    client = langfuse_client(receiver.url, mask=mask)
    tracing = LangfuseTracing(client)
    info = RolloutInfo(model=TrainableModel(name="masked"), framework="langgraph", rollout_id="langgraph-1",
                       trajectory_id=uuid.uuid4().hex[:12], input={"messages": [("user", "my card is 4111")]},
                       group_id=None)
    trace = tracing.start_rollout(info)
    trace.enter()
    trace.exit(None)
    trace.end()
    await tracing.aclose()
    assert receiver.wait_for(lambda r: r.trace(trace.trace_id), timeout=60)
    texts = [str(v) for span in receiver.trace(trace.trace_id) for v in span.attributes.values()]
    assert not any("4111" in text for text in texts), [t for t in texts if "4111" in t]
    client.shutdown()


async def test_bad_options_are_refused_up_front(model: TrainableModel, monkeypatch: pytest.MonkeyPatch):
    from art_core.errors import ConfigError

    for key in ("LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(_langfuse_options.OPTIONS, "default", None)
    with pytest.raises(ConfigError, match="LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY are not set"):
        trainable(react_graph(), model, langfuse=True)
    with pytest.raises(ConfigError, match="langfuse= takes True, False, a langfuse.Langfuse client"):
        TrainableRunner(model, langfuse="yes")
    with pytest.raises(ConfigError, match="flush_timeout is 0"):
        LangfuseTracing(langfuse_client("http://127.0.0.1:9"), flush_timeout=0)
