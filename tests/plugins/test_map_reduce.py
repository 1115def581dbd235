"""LangGraph map-reduce (``Send`` fan-out) on the in-process engine: ordinary sync nodes, async nodes, ``invoke``.

LangGraph runs a graph's synchronous nodes on the event loop's default thread pool, where each node that calls
the trainable model holds its thread until the gateway answers. The engine, the gateway and the training step
must never need a thread of that pool, or enough parallel nodes deadlock the run (issue 31). Here the pool gets
8 threads, fewer than the 16 nodes of one fan-out (a 2-core machine has 6; a 16-core one 20), so the hazard is
the same on every machine. The model is the tiny random Qwen2 (5 tokens a call): real graphs, the real gateway,
engine and trainer.

No test waits on a duration: a call is held by pausing the engine (a gate the test controls), and the
rollouts' ``timeout=`` is only a backstop that a regression (a hang) would hit.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import operator
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any, TypedDict

import httpx
import openai
import pytest
import pytest_asyncio
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

from art_core import LocalBackend, TrainableModel, Trajectory, TrajectoryGroup
from art_core.errors import ConfigError
from art_plugins import _routing
from art_plugins.langgraph import NoTrainableCallsError, trainable

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

NAME = "agent"
FAN_OUT = 16
POOL = 8  # threads of the loop's default pool: fewer than FAN_OUT
BACKSTOP = 600.0  # seconds: a backstop only a hang (the regression) reaches; a run takes a second, a minute under load
TOPICS = [f"topic number {i}" for i in range(FAN_OUT)]


class State(TypedDict):
    topics: list[str]
    answers: Annotated[list[str], operator.add]
    best: str


class Job(TypedDict):
    topic: str


def map_reduce(*, sync: bool, gate: threading.Event | None = None) -> Any:
    """LangGraph's map-reduce how-to: one ``work`` node per topic in parallel (``Send``), then ``best`` over them all.

    ``gate``: the ``best`` node waits for it before its call (the test releases it).
    """
    llm = ChatOpenAI(model=NAME, base_url=f"http://127.0.0.1:9/{uuid.uuid4().hex[:8]}/v1", api_key="unused",
                     temperature=1.0, max_tokens=5)

    def fan_out(state: State) -> list[Send]:
        return [Send("work", {"topic": topic}) for topic in state["topics"]]

    def best_prompt(state: State) -> str:
        return "Pick the best answer:\n" + "\n".join(state["answers"])

    if sync:
        def work(job: Job) -> dict[str, Any]:
            return {"answers": [llm.invoke(f"Tell me about {job['topic']}.").content]}

        def best(state: State) -> dict[str, Any]:
            if gate is not None:
                gate.wait()
            return {"best": llm.invoke(best_prompt(state)).content}
    else:
        async def work(job: Job) -> dict[str, Any]:  # type: ignore[misc]
            return {"answers": [(await llm.ainvoke(f"Tell me about {job['topic']}.")).content]}

        async def best(state: State) -> dict[str, Any]:  # type: ignore[misc]
            return {"best": (await llm.ainvoke(best_prompt(state))).content}

    builder = StateGraph(State)
    builder.add_node("work", work)
    builder.add_node("best", best)
    builder.add_conditional_edges(START, fan_out, ["work"])
    builder.add_edge("work", "best")
    builder.add_edge("best", END)
    return builder.compile()


def task(topics: list[str] = TOPICS) -> dict[str, Any]:
    return {"topics": topics, "answers": []}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TrainableModel]:
    # The module's loop gets a small default pool (it closes with the loop): fewer threads than parallel nodes.
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(POOL, thread_name_prefix="user-default"))
    model = TrainableModel(name=NAME, base_model=tiny_model_dir)
    async with LocalBackend(path=tmp_path_factory.mktemp("map-reduce"), show_progress=False) as backend:
        await model.register(backend)
        yield model


def engine_of(model: TrainableModel) -> Any:
    backend = model.backend
    assert isinstance(backend, LocalBackend)
    return backend.gateway(model.spec).engine


async def until(condition: Callable[[], bool]) -> None:
    """Wait until ``condition()`` holds: an event the test has no handle to await (no guess at how long it takes)."""
    while not condition():
        await asyncio.sleep(0.01)


def assert_every_call_captured(model: TrainableModel, trajectory: Trajectory, topics: list[str] = TOPICS) -> None:
    """Each of the run's calls is in the trajectory as the gateway recorded it, one history per distinct context:
    one per topic (its ``work`` call), and one for ``best``, whose prompt holds every answer the graph received."""
    assert not trajectory.metadata["truncated"], trajectory.metadata
    records = model.rollout_records(trajectory.metadata["rollout_id"])
    histories = trajectory.histories()
    calls = [call for history in histories for call in history.calls]
    assert len(records) == len(topics) + 1 and len(histories) == len(topics) + 1
    assert all(len(history.calls) == 1 for history in histories)
    by_id = {record.request_id: record for record in records}
    assert sorted(by_id) == sorted(call.request_id for call in calls)  # every call, each once
    for call in calls:  # token-exact: the ids the engine saw and sampled, not a re-rendering
        record = by_id[call.request_id]
        assert call.prompt_token_ids == record.prompt_token_ids and call.completion_token_ids
        assert call.completion_token_ids == record.completion_token_ids and call.logprobs == record.logprobs
    work = [r for r in records if r.caller == "work"]
    (best,) = [r for r in records if r.caller == "best"]
    asked = sorted(r.messages[-1]["content"] for r in work)
    assert asked == sorted(f"Tell me about {topic}." for topic in topics)
    # The graph got exactly the answers the records hold, and the best-of call saw them all.
    answers = trajectory.final_state["answers"]
    assert sorted(answers) == sorted(r.reply["content"] for r in work)
    assert best.messages[-1]["content"] == "Pick the best answer:\n" + "\n".join(answers)
    assert trajectory.final_state["best"] == best.reply["content"]


async def train_on(model: TrainableModel, group: TrajectoryGroup) -> None:
    """One GRPO step on ``group`` (rewards 0, 1, 2...): trained, from the records alone."""
    for reward, trajectory in enumerate(group.trajectories):
        trajectory.reward = float(reward)
    step = model.step
    metrics = await model.train([group])
    assert metrics["trained"] == 1.0 and model.step == step + 1
    assert metrics["samples"] == sum(len(t.histories()) for t in group.trajectories)
    assert metrics["samples_rerendered"] == 0.0  # token-exact: nothing was re-rendered through the template


@pytest.mark.parametrize("variant", ["sync", "async", "invoke"])
async def test_a_fan_out_of_16_parallel_nodes_is_captured_and_trained(model: TrainableModel, variant: str):
    agent = trainable(map_reduce(sync=variant != "async"), model, timeout=BACKSTOP)
    method = "invoke" if variant == "invoke" else "astream"
    trajectory = await agent.rollout(task(), method=method)
    assert_every_call_captured(model, trajectory)
    # A group of 4 such rollouts at once, seeded: 68 calls in parallel, each its own seed.
    group = await agent.group(task(), n=4, method=method, seed=31)
    assert group.exceptions == [] and len(group.trajectories) == 4
    for member in group.trajectories:
        assert_every_call_captured(model, member)
    completions = [tuple(c.completion_token_ids) for t in group.trajectories for h in t.histories() for c in h.calls]
    assert len(set(completions)) == len(completions)  # no two calls sampled alike: no seed was given twice
    await train_on(model, group)
    assert not _routing.installed()


async def test_the_gateway_answers_and_a_step_trains_while_user_code_holds_every_default_thread(
        model: TrainableModel):
    # The user's code blocks every thread of the loop's default pool, waiting for something else entirely. (The
    # agent libraries need that pool too: openai's async client and langchain-openai finish calls there. So the
    # gateway is called here with plain httpx, as any HTTP client would.)
    release = threading.Event()
    loop = asyncio.get_running_loop()
    held = [loop.run_in_executor(None, release.wait) for _ in range(POOL)]
    try:
        async with httpx.AsyncClient(timeout=BACKSTOP) as http:
            for k in range(4):
                body = {"model": NAME, "messages": [{"role": "user", "content": f"Question {k}?"}], "max_tokens": 8}
                response = await http.post(f"{model.rollout_base_url(f'held-{k}')}/chat/completions", json=body)
                assert response.status_code == 200, response.text
        group = TrajectoryGroup(model.rollout_trajectory(f"held-{k}") for k in range(4))
        await train_on(model, group)
        assert not any(future.done() for future in held)  # the pool stayed full throughout
    finally:
        release.set()
        await asyncio.gather(*held)


async def test_a_call_the_gateway_never_answered_is_named(model: TrainableModel):
    engine = engine_of(model)
    agent = trainable(map_reduce(sync=True), model)
    await engine.pause()  # the test holds the engine: the gateway receives the calls, nothing answers them
    try:
        async with agent.capture() as run:
            graph = asyncio.create_task(agent.graph.ainvoke(task(TOPICS[:3])))
            await until(lambda: model.rollout_status(run.rollout_id).unanswered == 3)
            graph.cancel()  # the rollout ends, as its timeout would end it; the nodes' threads still wait
            with contextlib.suppress(asyncio.CancelledError):
                await graph
        assert run.route.waiting_calls == 3 and run.route.calls_to_record == 0  # so settle() waits for no record
        await run.settle()
        with pytest.raises(NoTrainableCallsError) as caught:
            run.trajectory(stop_reason="timeout")
    finally:
        await engine.resume()
    message = str(caught.value)
    assert (f"rollout {run.rollout_id} sent 3 call(s) to the trainable model, but none completed with a sampled "
            "token: 3 received by the gateway and never answered (still in flight when the rollout ended)") in message
    assert "the gateway is serving: they are queued for or being sampled by the engine" in message
    assert "raise timeout=" not in message and "model_names" not in message  # no guess at a cause
    await until(lambda: model.rollout_status(run.rollout_id).unanswered == 0)  # answered once the engine runs


async def test_a_trajectory_counts_the_calls_still_unanswered_when_it_ended(model: TrainableModel):
    engine, gate = engine_of(model), threading.Event()
    agent = trainable(map_reduce(sync=True, gate=gate), model)
    topics = TOPICS[:2]
    try:
        async with agent.capture() as run:
            graph = asyncio.create_task(agent.graph.ainvoke(task(topics)))
            await until(lambda: len(model.rollout_records(run.rollout_id)) == len(topics))  # the work calls
            await engine.pause()
            gate.set()  # now ``best`` calls, and the engine holds it
            await until(lambda: model.rollout_status(run.rollout_id).unanswered == 1)
            graph.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await graph
        await run.settle()
        trajectory = run.trajectory(stop_reason="timeout")
    finally:
        gate.set()
        await engine.resume()
    assert trajectory.metadata["unanswered_calls"] == 1 and trajectory.metadata["truncated"]
    assert sorted(c.caller for h in trajectory.histories() for c in h.calls) == ["work", "work"]


async def test_a_run_stopped_before_any_call_does_not_blame_the_model_name(model: TrainableModel):
    # Every default thread is held, so the graph's first sync node never starts: the run calls nothing.
    release = threading.Event()
    loop = asyncio.get_running_loop()
    held = [loop.run_in_executor(None, release.wait) for _ in range(POOL)]
    agent = trainable(map_reduce(sync=True), model)
    try:
        async with agent.capture() as run:
            graph = asyncio.create_task(agent.graph.ainvoke(task(TOPICS[:1])))
            await asyncio.sleep(0)  # the graph starts; its first node can get no thread
            graph.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await graph
        await run.settle()
        with pytest.raises(NoTrainableCallsError) as caught:
            run.trajectory(stop_reason="timeout")
    finally:
        release.set()
        await asyncio.gather(*held)
    message = str(caught.value)
    assert "never called the trainable model" in message and "calls made in the rollout's context: none" in message
    assert "The run was stopped (timeout) before it made any call to the trainable model, or to any model" in message
    assert "default thread pool" in message and "model_names" not in message


async def test_a_sync_call_that_blocks_the_gateways_event_loop_is_refused_at_once(model: TrainableModel):
    # graph.invoke straight from a coroutine: the call would block the loop the gateway is served from, so no
    # answer could come (it hung until the client's timeout: 10 minutes an attempt with ChatOpenAI's defaults).
    # The routing layer refuses it before sending, with ChatOpenAI's default retries too.
    llm = ChatOpenAI(model=NAME, base_url=f"http://127.0.0.1:9/{uuid.uuid4().hex[:8]}/v1", api_key="unused",
                     max_tokens=8)
    with trainable(map_reduce(sync=True), model).capture() as run:
        with pytest.raises(ConfigError) as caught:
            llm.invoke("Hello?")
    assert "event loop that serves its gateway" in str(caught.value) and "asyncio.to_thread" in str(caught.value)
    assert run.route.routed_calls == 0  # nothing was sent


async def test_a_sync_call_from_another_threads_event_loop_is_answered_with_a_warning(
        model: TrainableModel, caplog: pytest.LogCaptureFixture):
    """A loop that does not serve the gateway (one of the user's own, in another thread) is blocked by the call, so
    the routing layer warns, but the gateway's loop is free and the call is answered."""
    llm = ChatOpenAI(model=NAME, base_url=f"http://127.0.0.1:9/{uuid.uuid4().hex[:8]}/v1", api_key="unused",
                     max_tokens=4, max_retries=0)

    async def blocking_call() -> str:
        return str(llm.invoke("Hello?").content)

    with caplog.at_level("WARNING", logger="art_plugins._routing"), trainable(map_reduce(sync=True), model).capture():
        context = contextvars.copy_context()  # the rollout's route follows the call into the thread
        answer = await asyncio.to_thread(context.run, asyncio.run, blocking_call())
    assert isinstance(answer, str)
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "art_plugins._routing"]
    assert "made from the thread of a running event loop" in warning and "asyncio.to_thread" in warning
