"""Rollouts cut mid-call by the adapters' ``timeout=``: the calls are kept, token-exact, and trained on.

The trainable model is the tiny random Qwen2: asked anything, it rambles (greedily) to the gateway's default
1024 tokens, as a new user's agent rambles on a CPU; the mid-call tests hold each call after its first tokens
(``held_mid_call``, a gate they never open), so the 1.5-second timeout lands inside the call on any machine. Each run must come back as a truncated trajectory
(``stop_reason="timeout"``) holding the call it cut, with exactly the tokens sampled before the cut; a GRPO
step then trains on those trajectories from their records alone (no re-rendering).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from agents import Agent, ModelSettings
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent
from transformers import AutoModelForCausalLM

from art_core import CallRecord, LocalBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
from art_plugins import _routing
from art_plugins._rollout import RolloutScope
from art_plugins.langgraph import NoTrainableCallsError, trainable
from art_plugins.openai_agents import TrainableRunner

pytestmark = [pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

NAME = "math-agent"
TIMEOUT = 1.5
CUT: list[Trajectory] = []  # every test's truncated trajectory, trained on by the last test


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TrainableModel]:
    model = TrainableModel(name=NAME, base_model=tiny_model_dir)
    async with LocalBackend(path=tmp_path_factory.mktemp("cut"), show_progress=False) as backend:
        await model.register(backend)
        yield model


@pytest.fixture
def held_mid_call(model: TrainableModel) -> Any:
    """Holds each call after its first tokens, on a gate this test never opens, until the rollout's timeout cuts it.

    So "a call still decoding when the timeout fires" holds on any machine, however fast it decodes (a quiet run
    once finished the 1024-token call inside the 1.5 s). The engine's ``stream`` is wrapped on this instance
    for the test only; the wrapper is removed after it.
    """
    engine = model.backend.gateway(model.spec).engine
    original, gate = engine.stream, asyncio.Event()

    async def stream(prompt_token_ids: list[int], params: Any) -> AsyncIterator[Any]:
        async with contextlib.aclosing(original(prompt_token_ids, params)) as deltas:
            delivered = 0
            async for delta in deltas:
                yield delta
                delivered += 1
                if delivered >= 4:
                    await gate.wait()  # cancelled by the cut: the call ends with the tokens delivered so far

    engine.stream = stream
    try:
        yield gate
    finally:
        del engine.stream  # the class's own method again
        gate.set()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Any:
    """The same weights, loaded apart from the engine: what the cut call must agree with."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def assert_cut_call_is_token_exact(trajectory: Trajectory, reference: Any) -> None:
    """One call, cut: its ids are the greedy continuation of its prompt, its logprobs the model's own."""
    assert trajectory.metadata["stop_reason"] == "timeout" and trajectory.metadata["truncated"] is True
    assert trajectory.metadata["cancelled_calls"] == 1
    (call,) = trajectory.calls
    assert call.finish_reason == "cancelled" and 0 < len(call.completion_token_ids) < 1024
    prompt = torch.tensor([call.prompt_token_ids])
    k = len(call.completion_token_ids)
    greedy = reference.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=k, do_sample=False,
                                min_new_tokens=k, pad_token_id=0)[0, prompt.shape[1]:].tolist()
    assert call.completion_token_ids == greedy
    ids = torch.tensor([call.prompt_token_ids + call.completion_token_ids])
    logits = reference(ids).logits[0, len(call.prompt_token_ids) - 1 : -1].log_softmax(-1)  # [k, V]
    scored = logits.gather(-1, torch.tensor(call.completion_token_ids)[:, None])[:, 0].tolist()
    assert call.logprobs == pytest.approx(scored, abs=1e-4)


async def test_a_langgraph_rollout_cut_mid_call_keeps_the_call(model: TrainableModel, reference: Any, held_mid_call: Any):
    llm = ChatOpenAI(model=NAME, base_url=f"http://127.0.0.1:9/{uuid.uuid4().hex[:8]}/v1", api_key="unused",
                     temperature=0.0)  # no max_tokens: the gateway's default of 1024, as a new user would run it
    graph = create_react_agent(llm, [add], prompt="Solve it with the tools.")
    trajectory = await trainable(graph, model, timeout=TIMEOUT).rollout({"messages": [("user", "What is 2 + 2?")]})
    assert_cut_call_is_token_exact(trajectory, reference)
    assert trajectory.calls[0].caller == "agent"  # the LangGraph node that made the call
    assert not _routing.installed()
    CUT.append(trajectory)


def solver() -> Agent[Any]:
    return Agent(name="Solver", instructions="Solve it.", model=NAME, model_settings=ModelSettings(temperature=0))


async def test_an_agents_sdk_run_cut_mid_call_keeps_the_call(model: TrainableModel, reference: Any, held_mid_call: Any):
    result, trajectory = await TrainableRunner(model, timeout=TIMEOUT).run(solver(), "What is 2 + 2?")
    assert result is None
    assert_cut_call_is_token_exact(trajectory, reference)
    assert trajectory.calls[0].caller == "Solver" and "timeout=1.5 s" in trajectory.metadata["error"]
    CUT.append(trajectory)


async def test_an_agents_sdk_streamed_run_cut_mid_call_keeps_the_call(model: TrainableModel, reference: Any, held_mid_call: Any):
    streamed = TrainableRunner(model, timeout=TIMEOUT).run_streamed(solver(), "What is 3 + 3?")
    deltas = 0
    async for event in streamed.stream_events():
        deltas += event.type == "raw_response_event" and event.data.type == "response.output_text.delta"
    _, trajectory = await streamed.wait()
    assert deltas > 0  # the call streamed live until the cut
    assert_cut_call_is_token_exact(trajectory, reference)
    assert not _routing.installed()
    CUT.append(trajectory)


async def test_an_agents_sdk_streamed_run_the_user_cancels_mid_call_keeps_the_call(model: TrainableModel,
                                                                                   held_mid_call: Any):
    """``streamed.result.cancel()`` while a call streams (held after its first tokens): the run ends marked
    ``stop_reason="cancelled"`` with the cut call kept. Its trajectory was fetched before the gateway had recorded
    the cut, and the run raised ``NoTrainableCallsError`` ("never answered") instead."""
    streamed = TrainableRunner(model).run_streamed(solver(), "What is 4 + 4?")
    async for event in streamed.stream_events():
        if event.type == "raw_response_event" and event.data.type == "response.output_text.delta":
            streamed.result.cancel()  # the call is held at the gate: cancelled mid-call, whatever the machine
    _, trajectory = await streamed.wait()
    assert trajectory.metadata["stop_reason"] == "cancelled" and trajectory.metadata["truncated"] is True
    (call,) = trajectory.calls
    assert call.finish_reason == "cancelled" and 0 < len(call.completion_token_ids) < 1024
    assert not trajectory.metadata.get("unanswered_calls") and not _routing.installed()


async def test_a_grpo_step_trains_on_the_cut_trajectories(model: TrainableModel):
    assert len(CUT) == 3, "run the whole module: this test trains on the trajectories the others cut"
    for reward, trajectory in zip([1.0, 0.0, 0.5], CUT, strict=True):
        trajectory.reward = reward
    metrics = await model.train([TrajectoryGroup(CUT)])
    assert metrics["trained"] == 1.0 and metrics["samples"] == 3.0
    assert metrics["samples_rerendered"] == 0.0  # token-exact from the records: nothing re-rendered
    assert metrics["trained_tokens"] == sum(len(t.calls[0].completion_token_ids) for t in CUT)
    assert model.step == 1


async def test_a_rollout_cut_before_its_first_token_says_why_there_is_nothing_to_train(model: TrainableModel):
    # A training step holds the gateway: the rollout's call waits, and its timeout cuts it before any token.
    # The step is held mid-way by its progress callback (called from the training thread after each
    # micro-batch), which waits for the test to release it: however fast the trainer, the step is still
    # running, and the gateway still paused, when the rollout's call arrives and is cut.
    prompt, completion = list(range(100, 500)), list(range(2000, 2400))
    busy = TrajectoryGroup(Trajectory(calls=[CallRecord(prompt_token_ids=prompt, completion_token_ids=completion)],
                                      reward=float(i % 2)) for i in range(8))
    in_step, release = threading.Event(), threading.Event()

    def hold(done: int, total: int) -> None:
        in_step.set()
        release.wait()

    training = asyncio.create_task(model.backend.train(model.spec, [busy], TrainConfig(), progress=hold))
    try:
        while not in_step.is_set():  # the step has paused the gateway and finished a micro-batch
            assert not training.done(), training
            await asyncio.sleep(0.01)
        llm = ChatOpenAI(model=NAME, base_url=f"http://127.0.0.1:9/{uuid.uuid4().hex[:8]}/v1", api_key="unused")
        graph = create_react_agent(llm, [add], prompt="Solve it with the tools.")
        with pytest.raises(NoTrainableCallsError, match=r"sent 1 call\(s\) to the trainable model, but none "
                                                        r"completed with a sampled token: 1 recorded with no token "
                                                        r"sampled.*raise timeout="):
            await trainable(graph, model, timeout=0.5).rollout({"messages": [("user", "What is 2 + 2?")]})
        assert not training.done()  # held by the test until here
    finally:
        release.set()
    result = await training
    assert result.metrics["trained"] == 1.0


async def test_a_call_cut_before_it_reached_the_gateway_is_not_waited_for(model: TrainableModel, held_mid_call: Any,
                                                                           monkeypatch: pytest.MonkeyPatch):
    """Two calls at once over a one-connection client: the second waits for the connection when the timeout
    cuts both (the first is held mid-call), so the second never reaches the gateway. The rollout must not wait
    for a record of it (it used to wait the whole 10-second settle bound).

    The settle bound is raised to an hour for this test, so a rollout that waits for the unsent call's record
    hangs (and pytest's timeout fails the test) instead of being told apart from a prompt one by a stopwatch."""
    monkeypatch.setattr(RolloutScope, "settle", functools.partialmethod(RolloutScope.settle, timeout=3600.0))
    import httpx2
    from langgraph.graph import END, START, MessagesState, StateGraph

    client = httpx2.AsyncClient(limits=httpx2.Limits(max_connections=1))
    llm = ChatOpenAI(model=NAME, base_url="http://127.0.0.1:9/v1", api_key="unused", temperature=0.0,
                     http_async_client=client)

    async def both(state: MessagesState) -> dict[str, Any]:
        first, second = await asyncio.gather(llm.ainvoke("What is 2 + 2?"), llm.ainvoke("What is 3 + 3?"))
        return {"messages": [first, second]}

    graph = StateGraph(MessagesState).add_node("both", both).add_edge(START, "both").add_edge("both", END).compile()
    try:
        trajectory = await trainable(graph, model, timeout=TIMEOUT).rollout({"messages": [("user", "go")]})
    finally:
        await client.aclose()
    assert trajectory.metadata["stop_reason"] == "timeout" and trajectory.metadata["cancelled_calls"] == 1
    assert len(trajectory.calls) == 1  # the call that was sent, cut; the other never left the client
