"""Small LangGraph graphs the adapter tests share (their chat models point nowhere: every trainable call is routed)."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AnyMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

INPUT = {"messages": [("user", "Write a haiku about rain.")]}


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def two_call_graph(**llm_options: Any) -> Any:
    """A drafter node and a reviser node, each one call of the trainable model (temperature 1, 10 tokens, unless
    ``llm_options`` say otherwise)."""
    llm = ChatOpenAI(model="agent", base_url=f"http://127.0.0.1:9/{uuid.uuid4().hex[:8]}/v1", api_key="unused",
                     **{"temperature": 1.0, "max_tokens": 10, **llm_options})

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
