"""The agent: a one-node LangGraph assistant answering geography questions, rewarded by RULER alone.

No reward function is written: an LLM judge compares the runs of each group and scores them
(``art_core.rewards.ruler_score_group``, the default rubric). A checker that knows the answers is used
only to measure the held-out success rate, never to train.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, AnyMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages

from art_core import Trajectory

__all__ = ["MODEL_NAME", "CapitalTask", "build_graph", "check", "make_tasks"]

MODEL_NAME = "geo"
SYSTEM = "You answer geography questions in one short sentence."
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Russia": "Moscow", "Egypt": "Cairo",
    "Canada": "Ottawa", "Australia": "Canberra", "Brazil": "Brasilia", "Argentina": "Buenos Aires",
    "Mexico": "Mexico City", "Kenya": "Nairobi", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki",
    "Poland": "Warsaw", "Greece": "Athens", "Turkey": "Ankara", "Peru": "Lima", "Chile": "Santiago",
    "Austria": "Vienna", "Hungary": "Budapest", "Ireland": "Dublin", "Thailand": "Bangkok", "Vietnam": "Hanoi",
    "Cuba": "Havana", "Denmark": "Copenhagen", "Belgium": "Brussels", "Netherlands": "Amsterdam",
    "Switzerland": "Bern", "Nigeria": "Abuja", "Morocco": "Rabat", "Iran": "Tehran", "Iraq": "Baghdad",
    "South Korea": "Seoul", "Indonesia": "Jakarta", "Colombia": "Bogota", "Ukraine": "Kyiv",
}


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def build_graph(*, base_url: str = "http://127.0.0.1:9/v1", temperature: float = 1.0, max_tokens: int = 24) -> Any:
    """One ``assistant`` node."""
    llm = ChatOpenAI(model=MODEL_NAME, base_url=base_url, api_key="unused", temperature=temperature,
                     max_tokens=max_tokens)

    async def assistant(state: State) -> dict[str, Any]:
        return {"messages": [await llm.ainvoke([SystemMessage(SYSTEM), *state["messages"]])]}

    graph = StateGraph(State)
    graph.add_node("assistant", assistant)
    graph.add_edge(START, "assistant")
    return graph.compile()


@dataclass(frozen=True)
class CapitalTask:
    country: str

    def input(self) -> dict[str, Any]:
        return {"messages": [("user", f"What is the capital of {self.country}?")]}


def make_tasks(n: int, *, seed: int, held_out: bool = False) -> list[CapitalTask]:
    """``n`` questions; the held-out ones come from the last 12 countries, the training ones from the rest."""
    countries = sorted(CAPITALS)
    random.Random(1234).shuffle(countries)  # a fixed split, whatever the seed
    pool = countries[-12:] if held_out else countries[:-12]
    rng = random.Random(seed)
    return [CapitalTask(rng.choice(pool)) for _ in range(n)]


def check(task: CapitalTask, trajectory: Trajectory, state: dict[str, Any] | None) -> float:
    """Measurement only (never a reward): 1.0 when the answer names the capital. Sets ``metrics["success"]``."""
    messages = (state or {}).get("messages", [])
    last = messages[-1] if messages else None
    text = last.content if isinstance(last, AIMessage) and isinstance(last.content, str) else ""
    success = float(CAPITALS[task.country].lower() in text.lower())
    trajectory.metrics["success"] = success
    return success
