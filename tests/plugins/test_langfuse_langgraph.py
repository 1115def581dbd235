"""The LangGraph handler of the Langfuse layer (``art_plugins._langfuse_langchain``) on real graphs.

Real LangGraph graphs, the real ``langfuse`` SDK and its LangChain ``CallbackHandler`` underneath, exporting to
``tests/langfuse_receiver.py`` (a real Langfuse server cannot run on this machine). The graphs' nodes make no
LLM call: what is checked is what the handler does with nodes, routing functions and states, which needs none
(the LLM path is checked end to end in ``test_langfuse.py``).
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.runnables import RunnableLambda
from langfuse import Langfuse
from langfuse._utils.serializer import EventSerializer
from langfuse_receiver import Receiver, Span
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from opentelemetry.sdk.trace import TracerProvider
from pydantic import BaseModel

from art_plugins._langfuse_langchain import BOOKKEEPING_KEYS, ROUTE_KEY, LightStateHandler

TOOL_CALL = {"name": "lookup", "args": {"q": "naïve café ☕", "depth": {"a": [1, 2.5, None, True]}}, "id": "call_1",
             "type": "tool_call"}


class State(TypedDict, total=False):
    messages: Annotated[list[AnyMessage], add_messages]
    turns: int
    notes: Any


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    receiver = Receiver().start()
    yield receiver
    receiver.close()


PUBLIC_KEY = f"pk-lf-{uuid.uuid4().hex[:8]}"  # the SDK keeps one client per key; the handler finds it by key


@pytest.fixture(scope="module")
def client(receiver: Receiver) -> Iterator[Langfuse]:
    client = Langfuse(public_key=PUBLIC_KEY, secret_key="sk-lf-test", base_url=receiver.url,
                      tracer_provider=TracerProvider(shutdown_on_exit=False), flush_interval=0.2)
    yield client
    client.shutdown()


def graph(*, extra: Any = None) -> Any:
    """Two turns of ``agent`` (an AI message with a tool call, then a tool message), routed by ``decide``,
    which asks a traced runnable (``inspect``) before choosing."""
    inspect = RunnableLambda(lambda state: len(state["messages"]), name="inspect")

    def agent(state: State) -> dict[str, Any]:
        turn = state.get("turns", 0) + 1
        update: dict[str, Any] = {"messages": [AIMessage(content=f"turn {turn} — ok", tool_calls=[TOOL_CALL]),
                                               ToolMessage(content="🙂 found", tool_call_id="call_1")],
                                  "turns": turn}
        if extra is not None:
            update["notes"] = extra
        return update

    def decide(state: State) -> str:
        inspect.invoke(state)
        return "agent" if state["turns"] < 2 else END

    builder = StateGraph(State)
    builder.add_node("agent", agent)
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", decide)
    return builder.compile()


def start_state() -> dict[str, Any]:
    return {"messages": [SystemMessage(content="Be brief."), HumanMessage(content="Où est le café ?")], "turns": 0}


def light(trace_id: str | None = None, **options: Any) -> LightStateHandler:
    return LightStateHandler(public_key=PUBLIC_KEY, trace_context={"trace_id": trace_id or Langfuse.create_trace_id()},
                             **options)


async def run(client: Langfuse, receiver: Receiver, compiled: Any, *, config: dict[str, Any] | None = None,
              **options: Any) -> list[Span]:
    """Run the graph under a ``LightStateHandler(**options)`` in a trace of its own; its spans, once exported."""
    trace_id = Langfuse.create_trace_id()
    await compiled.ainvoke(start_state(), config={**(config or {}), "callbacks": [light(trace_id, **options)]})
    client.flush()
    assert receiver.wait_for(lambda r: any(s.name == "LangGraph" for s in r.trace(trace_id)))
    return receiver.trace(trace_id)


async def test_routing_functions_fold_into_their_node(client: Langfuse, receiver: Receiver):
    spans = await run(client, receiver, graph(), config={"tags": ["mine"], "metadata": {"team": "search"}})
    by_id = {s.span_id: s for s in spans}
    names = [s.name for s in spans]
    assert "decide" not in names and names.count("agent") == 2
    agents = sorted((s for s in spans if s.name == "agent"), key=lambda s: s.metadata("langgraph_step"))
    # the route each routing function chose, on the node it left
    assert [s.metadata(ROUTE_KEY) for s in agents] == ["agent", END]
    # what the routing function ran is kept, under the node
    inspects = [s for s in spans if s.name == "inspect"]
    assert len(inspects) == 2 and all(by_id[s.parent_id].name == "agent" for s in inspects)
    assert sorted(json.loads(s.attributes["langfuse.observation.output"]) for s in inspects) == [4, 6]
    # LangGraph's bookkeeping is left out; the step, the node and the user's own metadata and tags stay
    for span in spans:
        keys = {k.rsplit(".", 1)[-1] for k in span.attributes if k.startswith("langfuse.observation.metadata.")}
        assert not keys & BOOKKEEPING_KEYS, (span.name, keys)
        assert "team" in keys, span.name
        tags = span.metadata("tags") or []
        assert "mine" in tags and not [t for t in tags if t.startswith(("seq:step:", "graph:step:"))], tags
    assert [(s.metadata("langgraph_step"), s.metadata("langgraph_node")) for s in agents] == [(1, "agent"),
                                                                                              (2, "agent")]


async def test_a_failing_routing_function_leaves_its_error_on_the_node(client: Langfuse, receiver: Receiver):
    def refuse(state: State) -> str:
        raise ValueError("no route for this state")

    builder = StateGraph(State)
    builder.add_node("agent", lambda state: {"turns": 1})
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", refuse)
    trace_id = Langfuse.create_trace_id()
    with pytest.raises(ValueError, match="no route"):
        await builder.compile().ainvoke(start_state(), config={"callbacks": [light(trace_id)]})
    client.flush()
    assert receiver.wait_for(lambda r: any(s.name == "agent" for s in r.trace(trace_id)))
    (node,) = [s for s in receiver.trace(trace_id) if s.name == "agent"]
    assert node.attributes["langfuse.observation.level"] == "ERROR"
    assert "no route for this state" in node.attributes["langfuse.observation.status_message"]
    assert not [s for s in receiver.trace(trace_id) if s.name == "refuse"]


@pytest.mark.parametrize("extra", [None, {"scores": [1, 2**60, math.nan, -math.inf], "path": ("a", "b")},
                                   [{"deep": {"er": {"still": ["plain"]}}}], "plain text", 3.25])
async def test_states_are_the_text_the_sdk_would_write(client: Langfuse, receiver: Receiver, extra: Any):
    # The same graph under the handler giving the SDK text and under the same handler giving it dicts (the
    # SDK's own path: media scan, then its serializer): every node's input and output must read the same.
    as_text = await run(client, receiver, graph(extra=extra))
    as_dicts = await run(client, receiver, graph(extra=extra), text_states=False)
    for key in ("langfuse.observation.input", "langfuse.observation.output"):
        text = sorted(s.attributes[key] for s in as_text if s.name in ("agent", "LangGraph"))
        dicts = sorted(s.attributes[key] for s in as_dicts if s.name in ("agent", "LangGraph"))
        assert text == dicts and len(text) == 3
    node_input = json.loads(next(s for s in as_text if s.name == "agent").attributes["langfuse.observation.input"])
    assert node_input["messages"][1] == {"role": "user", "content": "Où est le café ?"}


class Note(BaseModel):
    text: str


@pytest.mark.parametrize("extra", [Note(text="a pydantic model"), {"image": "data:image/png;base64,iVBORw0KGgo="},
                                   {1: "a non-string key"}])
def test_states_the_sdk_must_see_are_left_to_it(client: Langfuse, extra: Any):
    # Anything the SDK's media scan could change (a data URI, a model it dumps) or that is not plain JSON data
    # goes to the SDK as a dict (compacted), as before.
    handler = light()
    state = {"messages": [HumanMessage(content="hi")], "notes": extra}
    assert handler._state(state) == {"messages": [{"role": "user", "content": "hi"}], "notes": extra}
    plain = {"messages": [HumanMessage(content="hi")], "notes": "fine"}
    assert handler._state(plain) == json.dumps({"messages": [{"role": "user", "content": "hi"}], "notes": "fine"},
                                               cls=EventSerializer)
    image = {"messages": [HumanMessage(content=[{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,iVBORw0KGgo="}}])]}
    assert isinstance(handler._state(image), dict)  # a data URI inside a message, too


def test_a_client_with_a_mask_gets_dicts(receiver: Receiver):
    key = f"pk-lf-{uuid.uuid4().hex[:8]}"
    masked = Langfuse(public_key=key, secret_key="sk-lf-test", base_url=receiver.url,
                      tracer_provider=TracerProvider(shutdown_on_exit=False), mask=lambda *, data, **_: data)
    try:
        handler = LightStateHandler(public_key=key)
        assert handler.text_states is False
        assert handler._state({"turns": 1}) == {"turns": 1}
    finally:
        masked.shutdown()


def chat_graph() -> Any:
    """One node asking a chat model about the whole conversation (LangChain's ``GenericFakeChatModel`` stands in
    for the LLM: the prompt is what is checked, and the LLM path is checked end to end in ``test_langfuse.py``),
    then routed by ``decide`` as in ``graph``."""
    from langchain_core.language_models.fake_chat_models import GenericFakeChatModel

    llm = GenericFakeChatModel(messages=iter([AIMessage(content="one"), AIMessage(content="two")]))

    async def chat(state: State) -> dict[str, Any]:
        reply = await llm.ainvoke(state["messages"])
        turn = state.get("turns", 0) + 1
        extra = [AIMessage(content=f"turn {turn}", tool_calls=[TOOL_CALL], additional_kwargs={"name": "bot"}),
                 ToolMessage(content="🙂 found", tool_call_id="call_1")]
        return {"messages": [reply, *extra], "turns": turn}

    builder = StateGraph(State)
    builder.add_node("chat", chat)
    builder.add_edge(START, "chat")
    builder.add_conditional_edges("chat", lambda state: "chat" if state["turns"] < 2 else END)
    return builder.compile()


async def test_chat_prompts_and_routes_are_the_text_the_sdk_would_write(client: Langfuse, receiver: Receiver):
    # Chat prompts given as text (each message encoded once) and routes written straight onto the span must read
    # exactly as the SDK's own path writes them (the same handler giving the SDK messages and update()).
    from art_plugins import _langfuse_langchain

    assert _langfuse_langchain._ON_LLM_ACTION is not None  # the SDK still has the body the text prompt goes to
    as_text = await run(client, receiver, chat_graph())
    as_dicts = await run(client, receiver, chat_graph(), text_states=False)
    for span_name, key in (("GenericFakeChatModel", "langfuse.observation.input"),
                           ("chat", "langfuse.observation.metadata.langgraph_route")):
        text = sorted(s.attributes[key] for s in as_text if s.name == span_name)
        dicts = sorted(s.attributes[key] for s in as_dicts if s.name == span_name)
        assert text == dicts and len(text) == 2, (span_name, text, dicts)
    prompts = sorted((json.loads(s.attributes["langfuse.observation.input"]) for s in as_text
                      if s.name == "GenericFakeChatModel"), key=len)
    assert prompts[0] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Où est le café ?"}]
    assert prompts[1][3]["tool_calls"][0]["args"] == TOOL_CALL["args"] and prompts[1][3]["name"] == "bot"
    generations = [s for s in as_text if s.name == "GenericFakeChatModel"]
    assert all(s.attributes["langfuse.observation.type"] == "generation" for s in generations)
    by_id = {s.span_id: s for s in as_text}
    assert all(by_id[s.parent_id].name == "chat" for s in generations)


def test_chat_prompts_the_sdk_must_see_are_left_to_it(client: Langfuse):
    # Tools offered (the SDK appends their definitions to the prompt), a data URI (media the SDK uploads), or a
    # message type the SDK does not know: the SDK's own path.
    handler = light()
    messages = [[SystemMessage(content="Be brief."), HumanMessage(content="hi")]]
    assert handler._prompt_text(messages, {"invocation_params": {}}) == json.dumps(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], cls=EventSerializer)
    assert handler._prompt_text(messages, {"invocation_params": {"tools": [{"type": "function"}]}}) is None
    image = [[HumanMessage(content=[{"type": "image_url",
                                     "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}])]]
    assert handler._prompt_text(image, {"invocation_params": {}}) is None
    assert handler._prompt_text([[object()]], {"invocation_params": {}}) is None
