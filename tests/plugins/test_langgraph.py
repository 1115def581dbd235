"""The LangGraph adapter on real graphs: prebuilt ReAct, a custom StateGraph, two LLM nodes, trimming.

The graphs are unmodified LangGraph code whose nodes build ``ChatOpenAI(model="agent", base_url=<anything>)``.
The trainable model is a tiny Qwen2 fitted to follow these tests' scripts (see ``tests/scripted_model.py``):
a real model, served by the real gateway and engine, that calls the tools the scripts say.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypedDict

import httpx
import httpx2
import openai
import pytest
from langchain_core.messages import AnyMessage, SystemMessage
from langchain_core.runnables import RunnablePassthrough
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import MemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode, create_react_agent, tools_condition
from langgraph.runtime import Runtime
from langgraph.types import interrupt

from art_core import LocalBackend, TrainableModel
from art_core.engines.transformers import TransformersEngine
from art_core.gateway import Gateway, GatewaySettings
from art_plugins import _routing
from art_plugins.langgraph import NoTrainableCallsError, TrainableGraph, trainable
from scripted_model import call, fit_scripted_model, say, tool_result

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:create_react_agent:DeprecationWarning")


def _nowhere() -> str:
    """A graph's own base URL: never reached, every trainable call is routed. Unique per chat model, because
    langchain-openai shares one HTTP client per base URL, and each test runs in its own event loop."""
    return f"http://127.0.0.1:9/{uuid.uuid4().hex[:8]}/v1"


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@tool("add")
async def slow_add(a: int, b: int) -> int:
    """Add two integers."""
    await asyncio.Event().wait()  # never set: the tool hangs until the run's time limit cancels it
    return a + b


TOOLS = [convert_to_openai_tool(add), convert_to_openai_tool(multiply)]
REACT_SYSTEM = "You are a calculator. Use the tools."
ROUTED_SYSTEM = "You solve arithmetic with tools."
TRIM_SYSTEM = "Answer from the latest tool result."
WRITER_SYSTEM = "Write a greeting."


SCRIPT = [
    # The ReAct agent: two tool calls, then the answer.
    ([{"role": "system", "content": REACT_SYSTEM}, {"role": "user", "content": "What is (3 + 4) * 2?"},
      call("add", a=3, b=4), tool_result("7"), call("multiply", a=7, b=2), tool_result("14"), say("The answer is 14.")], TOOLS),
    # The custom graph's solver node.
    ([{"role": "system", "content": ROUTED_SYSTEM}, {"role": "user", "content": "Compute 5 + 6."},
      call("add", a=5, b=6), tool_result("11"), say("5 + 6 = 11.")], TOOLS),
    # The trimming graph: the first call sees the question, the second only the trimmed context.
    ([{"role": "system", "content": TRIM_SYSTEM}, {"role": "user", "content": "What is 2 + 2?"}, call("add", a=2, b=2)],
     TOOLS),
    ([{"role": "system", "content": TRIM_SYSTEM}, call("add", a=2, b=2), tool_result("4"), say("It is 4.")], TOOLS),
    # Two LLM nodes: the writer (trainable) and the critic (another model on another server).
    ([{"role": "system", "content": WRITER_SYSTEM}, {"role": "user", "content": "Greet Ada."}, say("Hello, Ada!")], []),
    ([{"role": "system", "content": "Rate the greeting."}, {"role": "user", "content": "Hello, Ada!"}, say("Good.")], []),
]


@pytest.fixture(scope="module")
def scripted_dir(smollm2_dir: Path) -> Path:
    return fit_scripted_model(smollm2_dir, SCRIPT)


@pytest.fixture
async def model(scripted_dir: Path, tmp_path: Path):
    model = TrainableModel(name="agent", base_model=scripted_dir)
    async with LocalBackend(path=tmp_path, show_progress=False) as backend:
        await model.register(backend)
        yield model


def _llm(name: str = "agent", base_url: str | None = None) -> ChatOpenAI:
    return ChatOpenAI(model=name, base_url=base_url or _nowhere(), api_key="unused", temperature=0.0, max_tokens=64)


def react_graph(tools: list[Any] | None = None) -> Any:
    return create_react_agent(_llm(), tools or [add, multiply], prompt=REACT_SYSTEM)


REACT_INPUT = {"messages": [("user", "What is (3 + 4) * 2?")]}


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    route: str


def routed_graph(call_config: dict[str, Any] | None = None) -> Any:
    """A router node (plain Python) in front of a solver LLM node and a ToolNode; ``call_config``: the config the
    solver passes to its model call (metadata of its own, say)."""
    llm = _llm().bind_tools([add, multiply])
    # In a chain: a sequence runs its steps under the config it was given, the node's metadata replaced by that
    chain = RunnablePassthrough() | llm if call_config else llm

    def router(state: State) -> dict[str, Any]:
        text = state["messages"][-1].content
        return {"route": "solver" if any(ch.isdigit() for ch in text) else "end"}

    def solver(state: State) -> dict[str, Any]:
        return {"messages": [chain.invoke([SystemMessage(ROUTED_SYSTEM), *state["messages"]], config=call_config)]}

    builder = StateGraph(State)
    builder.add_node("router", router)
    builder.add_node("solver", solver)
    builder.add_node("tools", ToolNode([add, multiply]))
    builder.add_edge(START, "router")
    builder.add_conditional_edges("router", lambda s: s["route"], {"solver": "solver", "end": END})
    builder.add_conditional_edges("solver", tools_condition)
    builder.add_edge("tools", "solver")
    return builder.compile()


def trimming_graph() -> Any:
    """An agent node that shows the model only the system prompt and the latest turns once tools have run."""
    llm = _llm().bind_tools([add, multiply])

    async def agent(state: State) -> dict[str, Any]:
        history = state["messages"]
        if history[-1].type == "tool":
            history = history[-2:]  # trim: the call and its result, nothing older
        return {"messages": [await llm.ainvoke([SystemMessage(TRIM_SYSTEM), *history])]}

    builder = StateGraph(State)
    builder.add_node("agent", agent)
    builder.add_node("tools", ToolNode([add, multiply]))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile()


def two_model_graph(critic_url: str) -> Any:
    writer_llm, critic_llm = _llm(), _llm("critic", critic_url)

    def writer(state: State) -> dict[str, Any]:
        return {"messages": [writer_llm.invoke([SystemMessage(WRITER_SYSTEM), *state["messages"]])]}

    def critic(state: State) -> dict[str, Any]:
        review = critic_llm.invoke([SystemMessage("Rate the greeting."), ("user", state["messages"][-1].content)])
        return {"route": review.content}

    builder = StateGraph(State)
    builder.add_node("writer", writer)
    builder.add_node("critic", critic)
    builder.add_edge(START, "writer")
    builder.add_edge("writer", "critic")
    builder.add_edge("critic", END)
    return builder.compile()


def _summary(message: Any) -> tuple[str, str, list[str]]:
    calls = [f"{c.function.name}{c.function.arguments}" for c in message.tool_calls or []]
    return message.role, message.text(), calls


def _assert_token_exact(trajectory: Any, model: TrainableModel) -> None:
    """Every trainable call is linked to its gateway record, and the tokens are the record's."""
    records = {r.request_id: r for r in model.rollout_records(trajectory.metadata["rollout_id"])}
    calls = [c for h in trajectory.histories() for c in h.calls]
    assert len(calls) == len(records) and {c.request_id for c in calls} == set(records)
    for linked in calls:
        record = records[linked.request_id]
        assert linked.completion_token_ids == record.completion_token_ids
        assert linked.prompt_token_ids == record.prompt_token_ids


# --- the four graphs ----------------------------------------------------------------------------------


async def test_prebuilt_react_agent_with_two_tools(model):
    agent = trainable(react_graph(), model)
    trajectory = await agent.rollout(REACT_INPUT, reward=lambda t, state: float("14" in state["messages"][-1].content))

    assert [_summary(m) for m in trajectory.messages] == [
        ("system", REACT_SYSTEM, []), ("user", "What is (3 + 4) * 2?", []),
        ("assistant", "", ['add{"a": 3, "b": 4}']), ("tool", "7", []),
        ("assistant", "", ['multiply{"a": 7, "b": 2}']), ("tool", "14", []),
        ("assistant", "The answer is 14.", []),
    ]
    assert {t["function"]["name"] for t in trajectory.tools} == {"add", "multiply"}
    assert len(trajectory.calls) == 3 and not trajectory.additional_histories
    assert [c.caller for c in trajectory.calls] == ["agent"] * 3  # the prebuilt agent's model node
    assert trajectory.reward == 1.0
    assert trajectory.final_state["messages"][-1].content == "The answer is 14."
    assert trajectory.metadata["truncated"] is False
    _assert_token_exact(trajectory, model)


@pytest.mark.parametrize("call_config", [None, {"metadata": {"purpose": "solve"}, "tags": ["solver-call"]}],
                         ids=["plain", "call-with-its-own-metadata"])
async def test_custom_state_graph_with_router_and_tool_node(model, call_config):
    """A call made with metadata of its own (as LangChain's summarisation middleware makes) keeps its node label:
    that metadata replaces the node's in the run config, the callbacks still inherit it."""
    agent = trainable(routed_graph(call_config), model)
    trajectory = await agent.rollout({"messages": [("user", "Compute 5 + 6.")]})

    assert [_summary(m) for m in trajectory.messages][1:] == [
        ("user", "Compute 5 + 6.", []), ("assistant", "", ['add{"a": 5, "b": 6}']), ("tool", "11", []),
        ("assistant", "5 + 6 = 11.", []),
    ]
    assert [c.caller for c in trajectory.calls] == ["solver", "solver"]
    assert trajectory.final_state["route"] == "solver"
    _assert_token_exact(trajectory, model)


async def test_an_azure_deployment_of_the_models_name_is_routed(model):
    """``AzureChatOpenAI(azure_deployment=...)`` names the model in the URL only (the body's ``model`` is null)."""
    from langchain_openai import AzureChatOpenAI

    llm = AzureChatOpenAI(azure_deployment="agent", azure_endpoint=_nowhere().removesuffix("/v1"),
                          api_version="2024-10-21", api_key="unused", temperature=0.0, max_tokens=64)
    graph = create_react_agent(llm, [add, multiply], prompt=REACT_SYSTEM)
    trajectory = await trainable(graph, model).rollout(REACT_INPUT)
    assert len(trajectory.calls) == 3 and trajectory.final_state["messages"][-1].content == "The answer is 14."


async def test_only_the_trainable_node_is_routed(model, scripted_dir):
    """The critic node's model is served elsewhere: its call reaches that server, untouched."""
    engine = await TransformersEngine.from_pretrained(scripted_dir)
    try:
        async with Gateway(engine, GatewaySettings(model_name="critic")) as critic_server:
            agent = trainable(two_model_graph(critic_server.base_url), model)
            trajectory = await agent.rollout({"messages": [("user", "Greet Ada.")]})
            critic_calls = critic_server.records.for_rollout(None)
    finally:
        await engine.aclose()
    assert [_summary(m) for m in trajectory.messages][-1] == ("assistant", "Hello, Ada!", [])
    assert [c.caller for c in trajectory.calls] == ["writer"]
    assert len(critic_calls) == 1 and critic_calls[0].reply["content"] == "Good."
    assert trajectory.final_state["route"] == "Good."


async def test_calls_in_subgraphs_are_labelled_with_their_node_path_and_any_name_round_trips(model):
    """Two sub-agents built alike (each a subgraph with a node "write") are told apart by the path of the node that
    made the call; node names that are not ASCII, hold a "%" or are very long reach the record as they are
    (a long one shortened to 200 characters), never refused by the gateway."""
    long_name = "step " * 60  # 300 characters

    def writer_subgraph() -> Any:
        llm = _llm()

        def write(state: State) -> dict[str, Any]:
            return {"messages": [llm.invoke([SystemMessage(WRITER_SYSTEM), state["messages"][0]])]}

        return StateGraph(State).add_node("write", write).add_edge(START, "write").compile()

    builder = StateGraph(State)
    for name in ("équipe 写作", "50%_off", long_name):
        builder.add_node(name, writer_subgraph())
    builder.add_edge(START, "équipe 写作").add_edge("équipe 写作", "50%_off").add_edge("50%_off", long_name)
    trajectory = await trainable(builder.compile(), model).rollout({"messages": [("user", "Greet Ada.")]})

    shortened = (long_name + "/write")[:197] + "..."
    assert sorted(c.caller for h in trajectory.histories() for c in h.calls) == sorted(
        ["équipe 写作/write", "50%_off/write", shortened])
    assert len(shortened) == 200


@dataclass
class Greeting:
    """A graph's runtime context (``StateGraph(..., context_schema=Greeting)``)."""

    system_prompt: str


@pytest.mark.parametrize("method", ["invoke", "ainvoke", "astream", "astream_events"])
async def test_a_graph_reads_the_runtime_context_the_rollout_passes(model, method):
    """LangGraph's runtime context (``graph.invoke(input, context=...)``, read by nodes as ``runtime.context``)
    is passed by ``rollout`` and ``group`` whatever the method."""
    llm = _llm()

    def writer(state: State, runtime: Runtime[Greeting]) -> dict[str, Any]:
        return {"messages": [llm.invoke([SystemMessage(runtime.context.system_prompt), *state["messages"]])]}

    graph = (StateGraph(State, context_schema=Greeting).add_node("writer", writer).add_edge(START, "writer")
             .compile())
    agent = trainable(graph, model)
    group = await agent.group({"messages": [("user", "Greet Ada.")]}, n=2, context=Greeting(WRITER_SYSTEM),
                              method=method)
    assert not group.exceptions and len(group) == 2
    for trajectory in group:
        assert [_summary(m) for m in trajectory.messages] == [
            ("system", WRITER_SYSTEM, []), ("user", "Greet Ada.", []), ("assistant", "Hello, Ada!", [])]


async def test_a_trimmed_context_becomes_an_additional_history(model):
    trajectory = await trainable(trimming_graph(), model).rollout({"messages": [("user", "What is 2 + 2?")]})

    # The run ended in the trimmed context; the context before the trim is kept whole beside it.
    assert [_summary(m) for m in trajectory.messages] == [
        ("system", TRIM_SYSTEM, []), ("assistant", "", ['add{"a": 2, "b": 2}']), ("tool", "4", []),
        ("assistant", "It is 4.", []),
    ]
    (before,) = trajectory.additional_histories
    assert [_summary(m) for m in before.messages] == [
        ("system", TRIM_SYSTEM, []), ("user", "What is 2 + 2?", []), ("assistant", "", ['add{"a": 2, "b": 2}']),
    ]
    assert len(trajectory.calls) == 1 and len(before.calls) == 1
    _assert_token_exact(trajectory, model)


# --- how the graph is run ------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["invoke", "ainvoke", "astream", "astream_events"])
async def test_every_run_method_is_captured(model, method):
    trajectory = await trainable(react_graph(), model).rollout(REACT_INPUT, method=method)
    assert len(trajectory.calls) == 3
    assert trajectory.final_state["messages"][-1].content == "The answer is 14."


@pytest.mark.parametrize("method", ["invoke", "ainvoke", "astream", "astream_events"])
async def test_an_interrupted_run_says_so_in_its_final_state_and_metadata_whatever_the_method(model, method):
    """A human-in-the-loop graph (``interrupt()`` after the agent): a reward reads ``__interrupt__`` from the final
    state, which ``astream_events``'s root end event leaves out (LangGraph sends it only as a stream chunk)."""
    agent_graph = react_graph()

    def solve(state: State) -> dict[str, Any]:  # sync, so that every method (invoke too) can run the graph
        return {"messages": agent_graph.invoke({"messages": state["messages"]})["messages"]}

    def confirm(state: State) -> dict[str, Any]:
        return {"route": interrupt("Send this answer?")}

    builder = StateGraph(State).add_sequence([solve, confirm])  # nodes named after the functions
    graph = builder.add_edge(START, "solve").compile(checkpointer=MemorySaver())
    trajectory = await trainable(graph, model).rollout(
        REACT_INPUT, method=method, config={"configurable": {"thread_id": uuid.uuid4().hex}})
    assert len(trajectory.calls) == 3 and trajectory.messages[-1].text() == "The answer is 14."
    assert [i.value for i in trajectory.final_state["__interrupt__"]] == ["Send this answer?"]
    assert trajectory.final_state["messages"][-1].content == "The answer is 14."
    # paused, not finished: marked as the Agents SDK adapter marks a run waiting for approval
    assert trajectory.metadata["stop_reason"] == "interrupted" and trajectory.metadata["truncated"] is True
    assert trajectory.metadata["interruptions"] == "confirm"
    if method == "ainvoke":  # without a checkpointer only the final state tells, not which node
        unsaved = await trainable(builder.compile(), model).rollout(REACT_INPUT, method=method)
        assert unsaved.metadata["stop_reason"] == "interrupted" and unsaved.metadata["interruptions"] == "interrupt()"


@pytest.mark.parametrize("method", ["invoke", "ainvoke", "astream", "astream_events"])
async def test_a_static_breakpoint_leaves_the_same_final_state_whatever_the_method(model, method):
    """``interrupt_before=[...]`` stops before a node without an ``interrupt()``: LangGraph's own final state has no
    ``__interrupt__`` then, and ``astream_events`` (which streams an empty tuple for it) must not add one; the
    checkpointer's snapshot says the run paused, and the trajectory is marked so."""
    agent_graph = react_graph()

    def solve(state: State) -> dict[str, Any]:
        return {"messages": agent_graph.invoke({"messages": state["messages"]})["messages"]}

    def send(state: State) -> dict[str, Any]:
        return {}

    graph = (StateGraph(State).add_sequence([solve, send]).add_edge(START, "solve")
             .compile(checkpointer=MemorySaver(), interrupt_before=["send"]))
    trajectory = await trainable(graph, model).rollout(
        REACT_INPUT, method=method, config={"configurable": {"thread_id": uuid.uuid4().hex}})
    assert "__interrupt__" not in trajectory.final_state
    assert trajectory.final_state["messages"][-1].content == "The answer is 14."
    assert trajectory.metadata["stop_reason"] == "interrupted" and trajectory.metadata["interruptions"] == "send"
    if method == "astream":  # the thread bound with with_config (as create_agent's graphs are), not passed
        bound = graph.with_config(configurable={"thread_id": uuid.uuid4().hex})
        paused = await trainable(bound, model).rollout(REACT_INPUT, method=method)
        assert paused.metadata["stop_reason"] == "interrupted" and paused.metadata["interruptions"] == "send"
    # the same graph without the breakpoint runs to its end, and is not marked
    whole = (StateGraph(State).add_sequence([solve, send]).add_edge(START, "solve")
             .compile(checkpointer=MemorySaver()))
    finished = await trainable(whole, model).rollout(
        REACT_INPUT, method=method, config={"configurable": {"thread_id": uuid.uuid4().hex}})
    assert "stop_reason" not in finished.metadata and finished.metadata["truncated"] is False


async def test_a_scope_around_the_users_own_stream(model):
    agent = trainable(react_graph(), model)
    with agent.capture() as run:
        # The sync API in a worker thread (the gateway shares this event loop); to_thread carries the scope along.
        chunks = await asyncio.to_thread(lambda: list(agent.graph.stream(REACT_INPUT, stream_mode="values")))
    trajectory = run.trajectory(final_state=chunks[-1])
    assert len(trajectory.calls) == 3 and trajectory.messages[-1].text() == "The answer is 14."


async def test_the_decorator_wraps_a_graph_builder(model):
    @trainable(model)
    def build() -> Any:
        return react_graph()

    agent = build()
    assert isinstance(agent, TrainableGraph)
    assert len((await agent.rollout(REACT_INPUT)).calls) == 3


async def test_concurrent_rollouts_never_mix_records(model):
    agent = trainable(react_graph(), model)
    trajectories = await asyncio.gather(*(agent.rollout(REACT_INPUT) for _ in range(8)))

    rollout_ids = {t.metadata["rollout_id"] for t in trajectories}
    assert len(rollout_ids) == 8
    request_ids = [c.request_id for t in trajectories for c in t.calls]
    assert len(request_ids) == 24 == len(set(request_ids))
    for trajectory in trajectories:
        assert {c.rollout_id for c in trajectory.calls} == {trajectory.metadata["rollout_id"]}
        assert trajectory.messages[-1].text() == "The answer is 14."
        _assert_token_exact(trajectory, model)


async def test_a_grpo_step_trains_on_the_captured_group(model):
    rewards = itertools.cycle([0.0, 1.0])
    group = await trainable(react_graph(), model).group(REACT_INPUT, n=4, reward=lambda t, s: next(rewards))
    assert len(group) == 4 and not group.exceptions

    metrics = await model.train([group])
    assert model.step == 1
    assert metrics["samples_rerendered"] == 0  # every sample came token-exact from the gateway
    assert metrics["sampler_logprob_abs_diff"] < 1e-4


async def test_no_patch_outlives_the_scope(model):
    originals = (httpx.AsyncClient.send, httpx.Client.send, httpx2.AsyncClient.send, httpx2.Client.send)
    agent = trainable(react_graph(), model)
    with agent.capture():
        assert _routing.installed() and httpx2.AsyncClient.send is not originals[2]
    await agent.rollout(REACT_INPUT)
    assert not _routing.installed()
    assert (httpx.AsyncClient.send, httpx.Client.send, httpx2.AsyncClient.send, httpx2.Client.send) == originals


# --- bad input -----------------------------------------------------------------------------------------


async def test_a_graph_that_never_calls_the_trainable_model_is_a_clear_error(model, scripted_dir):
    engine = await TransformersEngine.from_pretrained(scripted_dir)
    try:
        async with Gateway(engine, GatewaySettings(model_name="critic")) as other:
            graph = create_react_agent(_llm("critic", other.base_url), [add], prompt="Rate the greeting.")
            with pytest.raises(NoTrainableCallsError, match=r"never called the trainable model.*'critic' \(1x\)"):
                await trainable(graph, model).rollout({"messages": [("user", "Hello, Ada!")]})
    finally:
        await engine.aclose()


async def test_a_failed_call_to_an_unrouted_model_says_it_was_not_routed(model):
    # The user's chat model names the trainable model "gpt-4o-mini" and no model_names says so: the call goes to
    # its own endpoint (here nothing listens) and the agent's error alone would not say it never reached the gateway.
    unrouted = ChatOpenAI(model="gpt-4o-mini", base_url=_nowhere(), api_key="unused", max_tokens=8, max_retries=0)
    with pytest.raises(openai.APIConnectionError) as caught:
        await trainable(create_react_agent(unrouted, [add]), model).rollout(REACT_INPUT)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert f"'gpt-4o-mini' (1x); routed names: [{model.name!r}]" in notes and "model_names=[...]" in notes
    group = await trainable(create_react_agent(unrouted, [add]), model).group(REACT_INPUT, n=2, reward=lambda t, s: 1.0)
    assert len(group) == 0 and all("'gpt-4o-mini' (1x); routed names:" in error for error in group.exceptions)

    agent_graph = react_graph()

    def solve_then_fail(state: State) -> dict[str, Any]:
        agent_graph.invoke({"messages": state["messages"]})  # its three calls are all routed
        raise ValueError("a node's own bug")

    graph = StateGraph(State).add_node(solve_then_fail).add_edge(START, "solve_then_fail").compile()
    with pytest.raises(ValueError, match="a node's own bug") as caught:  # no unrouted call: nothing to add
        await trainable(graph, model).rollout(REACT_INPUT)
    assert not [n for n in getattr(caught.value, "__notes__", []) if "art-plugins" in n]  # LangGraph adds its own


async def test_a_reward_function_that_raises_is_recorded_and_the_group_goes_on(model):
    calls = itertools.count()

    def flaky(trajectory: Any, state: Any) -> float:
        if next(calls) == 1:
            raise ValueError("judge unavailable")
        return 1.0

    group = await trainable(react_graph(), model).group(REACT_INPUT, n=3, reward=flaky)
    assert len(group) == 3
    failed = [t for t in group if "reward_error" in t.metadata]
    assert len(failed) == 1 and failed[0].metadata["reward_error"] == "ValueError: judge unavailable"
    assert failed[0].reward == 0.0 and any("judge unavailable" in line for line in failed[0].logs)
    assert sorted(t.reward for t in group) == [0.0, 1.0, 1.0]


async def test_a_run_over_its_step_limit_is_kept_and_marked_truncated(model):
    # router, solver (the model's first call), then the ToolNode would be step 3: over the limit.
    agent = trainable(routed_graph(), model, recursion_limit=2)
    trajectory = await agent.rollout({"messages": [("user", "Compute 5 + 6.")]})
    assert trajectory.metadata["truncated"] is True and trajectory.metadata["stop_reason"] == "recursion_limit"
    assert len(trajectory.calls) == 1
    assert trajectory.final_state["messages"][-1].tool_calls[0]["name"] == "add"  # the last state it reached


@pytest.mark.parametrize("method", ["invoke", "ainvoke", "astream", "astream_events"])
async def test_a_step_limit_set_on_the_graph_holds_whatever_the_method(model, method):
    """``graph.with_config(recursion_limit=2)``: LangGraph's ``astream_events`` alone leaves a limit bound that way
    out (1.2); the rollout passes it on, so every method stops where the others do."""
    agent = trainable(routed_graph().with_config(recursion_limit=2), model)
    trajectory = await agent.rollout({"messages": [("user", "Compute 5 + 6.")]}, method=method)
    assert trajectory.metadata["truncated"] is True and trajectory.metadata["stop_reason"] == "recursion_limit"
    assert len(trajectory.calls) == 1


async def test_a_run_over_its_time_limit_is_kept_and_marked_truncated(model):
    graph = create_react_agent(_llm(), [slow_add, multiply], prompt=REACT_SYSTEM)
    # The limit only has to outlast the tiny model's first call (a fraction of a second quiet): 10 s leaves a
    # wide margin for a loaded machine; the tool itself never returns, so the limit always ends the run.
    trajectory = await trainable(graph, model, timeout=10).rollout(REACT_INPUT)
    assert trajectory.metadata["stop_reason"] == "timeout" and trajectory.metadata["truncated"] is True
    assert len(trajectory.calls) == 1 and trajectory.messages[-1].tool_calls[0].function.name == "add"
