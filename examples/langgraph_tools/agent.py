"""The agent: a LangGraph calculator that must call the right tool, then report its result.

This is ordinary LangGraph code, written as for any OpenAI model: an ``agent`` node calls a chat model
with three tools bound, a ``ToolNode`` runs the calls, and the graph loops until the model answers in
text. Nothing in it knows about training; ``trainable(graph, model)`` does the rest.

The job, per question ("What is 47 times 86?"): call ``multiply`` (or ``add``) with the two numbers,
then answer with the number the tool returned. The numbers are two-digit, so the model cannot
do the sum itself, and the reward checks both halves of the job:

- 1.0: the right tool with the right arguments, and the final answer's last number is the result;
- 0.3: the right call, but the answer does not carry the result (or never comes);
- 0.1: a well-formed call to a tool that exists, but the wrong tool or wrong numbers;
- 0.0: no usable tool call (answers from its own head, or malformed calls).

A rollout "succeeds" only with the full 1.0. The partial credits give GRPO groups with different rewards
while the base model rarely gets everything right.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode, tools_condition

from art_core import Trajectory

__all__ = ["MODEL_NAME", "TOOLS", "CalcTask", "build_graph", "make_tasks", "reward"]

MODEL_NAME = "calc"
"""The name the graph's chat model asks for; the trainable model is registered under it."""


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


TOOLS = [add, multiply]
_OPERATIONS = {"plus": "add", "times": "multiply"}

# Short on purpose: every call re-reads the whole prompt, and on a CPU reading it costs more than writing.
SYSTEM = "Call a tool, then answer with its result."
# One worked exchange shows the small model the shape of a tool call and of the answer.
EXAMPLE = [
    HumanMessage("What is 12 plus 30?"),
    AIMessage("", tool_calls=[{"name": "add", "args": {"a": 12, "b": 30}, "id": "call_0"}]),
    ToolMessage("42", tool_call_id="call_0"),
    AIMessage("12 plus 30 is 42."),
]


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def build_graph(*, base_url: str = "http://127.0.0.1:9/v1", temperature: float = 1.0) -> Any:
    """The compiled graph: ``agent`` (chat model with tools) <-> ``tools`` (ToolNode), until a text answer.

    Args:
        base_url: the app's own OpenAI endpoint; during rollouts the calls go to the gateway instead.
        temperature: sampling temperature of the agent's model (1.0 explores, for training).
    """
    llm = ChatOpenAI(model=MODEL_NAME, base_url=base_url, api_key="unused", temperature=temperature)
    # The first turn must call a tool ("required": the server constrains the reply to a tool call, ~37
    # tokens); once a result is in, the model may call again or answer in a short sentence.
    first_turn = llm.bind_tools(TOOLS, tool_choice="required", max_tokens=44)
    later_turns = llm.bind_tools(TOOLS, max_tokens=20)

    async def agent(state: State) -> dict[str, Any]:
        has_result = any(isinstance(m, ToolMessage) for m in state["messages"])
        chat = later_turns if has_result else first_turn
        return {"messages": [await chat.ainvoke([SystemMessage(SYSTEM), *EXAMPLE, *state["messages"]])]}

    graph = StateGraph(State)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(TOOLS, handle_tool_errors=True))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()


@dataclass(frozen=True)
class CalcTask:
    a: int
    operation: str
    """``plus`` or ``times``."""
    b: int

    @property
    def question(self) -> str:
        return f"What is {self.a} {self.operation} {self.b}?"

    @property
    def tool(self) -> str:
        return _OPERATIONS[self.operation]

    @property
    def answer(self) -> int:
        return self.a + self.b if self.operation == "plus" else self.a * self.b

    def input(self) -> dict[str, Any]:
        """The graph's input."""
        return {"messages": [("user", self.question)]}


def make_tasks(n: int, *, seed: int) -> list[CalcTask]:
    """``n`` questions on two-digit numbers, operations mixed."""
    rng = random.Random(seed)
    return [CalcTask(rng.randint(11, 99), rng.choice(list(_OPERATIONS)), rng.randint(11, 99)) for _ in range(n)]


_NUMBER = re.compile(r"-?\d[\d,]*")


def _numbers(text: str) -> list[int]:
    return [int(n.replace(",", "")) for n in _NUMBER.findall(text) if n.replace(",", "").lstrip("-").isdigit()]


def grade(task: CalcTask, messages: list[Any]) -> dict[str, float]:
    """What the run did: ``right_call``, ``answered`` (the final text ends on the result), ``valid_tool_calls``."""
    calls = [c for m in messages if isinstance(m, AIMessage) for c in m.tool_calls]
    invalid = sum(len(m.invalid_tool_calls) for m in messages if isinstance(m, AIMessage))
    names = {t.name for t in TOOLS}
    valid = [c for c in calls if c["name"] in names and set(c["args"]) == {"a", "b"}]
    right_call = any(c["name"] == task.tool and c["args"] == {"a": task.a, "b": task.b} for c in valid)
    last = messages[-1] if messages else None
    final_text = last.content if isinstance(last, AIMessage) and not last.tool_calls else ""
    numbers = _numbers(final_text) if isinstance(final_text, str) else []
    answered = bool(numbers) and numbers[-1] == task.answer  # the last number: "47 times 86 is 4042."
    made = len(calls) + invalid
    return {"right_call": float(right_call), "answered": float(answered),
            "any_valid_call": float(bool(valid)), "valid_tool_calls": len(valid) / made if made else 0.0}


def reward(task: CalcTask) -> Any:
    """The reward function for one task: ``fn(trajectory, final_state) -> float`` (see the module docstring)."""

    def score(trajectory: Trajectory, state: dict[str, Any] | None) -> float:
        marks = grade(task, (state or {}).get("messages", []))
        success = marks["right_call"] * marks["answered"]
        trajectory.metrics.update(marks)
        trajectory.metrics["success"] = success
        if success:
            return 1.0
        if marks["right_call"]:
            return 0.3
        return 0.1 if marks["any_valid_call"] else 0.0

    return score
