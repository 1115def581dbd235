"""The agent: a LangGraph email assistant that searches an inbox, reads an email and answers with its source.

Ordinary LangGraph code, as for any OpenAI model: an ``agent`` node calls a chat model with three tools
bound, a ``ToolNode`` runs them against the mailbox (``mailbox.py``, SQLite + FTS5), and the loop ends
when the model calls ``return_answer``:

- ``search_inbox(keywords, sender=None, after=None, before=None)``: up to three ``id | date | sender |
  subject`` lines, best match first;
- ``read_email(id)``: the whole email;
- ``return_answer(answer, source_id)``: the final answer and the id of the email it came from.

Sized for a 135M model: every turn must be a tool call (``tool_choice``): a search, a read, then a free
choice, and the fourth and last an answer (``TURN_CHOICES``); closed schemas with length limits keep the
arguments short; the system prompt is one sentence, and one worked exchange shows the whole path.

Reward, with partial credit so that a GRPO group of the base model's runs differs:

- 0.5: the answer is right (the expected words, in order, in a short answer);
- 0.2: the cited ``source_id`` is the email that holds the answer;
- 0.2: the agent read that email;
- 0.1: one of its searches listed that email.

Success (held-out): a right answer citing the right email. A reward for the whole path, not only the
outcome, is a choice made for the small model: the partial credits give GRPO something to compare while
the base model rarely answers right.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, TypedDict

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import BaseTool, tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode
from pydantic import Field

from art_core import Trajectory

from .mailbox import Mailbox, Question

__all__ = ["MAX_TURNS", "MODEL_NAME", "build_graph", "grade", "make_tools", "reward"]

MODEL_NAME = "email-agent"
"""The name the graph's chat model asks for; the trainable model is registered under it."""
MAX_TURNS = 4
"""Model calls per run: search, read, a free choice (answer, or search or read again), answer."""
MAX_ANSWER_WORDS = 8
"""A longer "answer" (e.g. the whole email pasted back) does not count as right."""
TURN_CHOICES = ["search_inbox", "read_email", "required", "return_answer"]
"""``tool_choice`` per turn: the small model wanders off the path otherwise (probed: a second search instead
of a read), so the path is fixed and the arguments are the model's."""

SYSTEM = "Find the answer in the inbox: search, read the best email, then return_answer with its id."
# One worked exchange (a colleague and ids that are not in the mailbox) shows the small model every step.
EXAMPLE = [
    HumanMessage("Where is the design review with Zoe?"),
    AIMessage("", tool_calls=[{"name": "search_inbox", "args": {"keywords": "design review Zoe"}, "id": "call_0"}]),
    ToolMessage("id 512 | 2026-02-11 | Zoe Park | Design review location", tool_call_id="call_0"),
    AIMessage("", tool_calls=[{"name": "read_email", "args": {"id": 512}, "id": "call_1"}]),
    ToolMessage("From: Zoe Park\nSubject: Design review location\n\nWe booked Room 9D for the design review.",
                tool_call_id="call_1"),
    AIMessage("", tool_calls=[{"name": "return_answer", "args": {"answer": "Room 9D", "source_id": 512},
                               "id": "call_2"}]),
    ToolMessage("Answer recorded.", tool_call_id="call_2"),
]


_DATE = r"^\d{4}-\d{2}-\d{2}$"


def make_tools(mailbox: Mailbox) -> list[BaseTool]:
    """The agent's three tools over ``mailbox``."""

    # Length limits and the date pattern go into the schema, so the server's constrained decoding keeps every
    # argument short: unconstrained, the 135M model filled its 48 tokens with a rambling keyword string.
    @tool
    def search_inbox(keywords: Annotated[str, Field(max_length=40)],
                     sender: Annotated[str, Field(max_length=20)] | None = None,
                     after: Annotated[str, Field(pattern=_DATE)] | None = None,
                     before: Annotated[str, Field(pattern=_DATE)] | None = None) -> str:
        """Search the inbox. keywords: words to look for; sender: part of a sender's name; after/before:
        dates like 2026-03-01. Returns up to 3 lines: id | date | sender | subject."""
        try:
            found = mailbox.search(keywords, sender=sender, after=after, before=before)
        except ValueError as exc:
            return f"Error: {exc}"
        return "\n".join(f"id {e.id} | {e.date} | {e.sender.split(' <')[0]} | {e.subject}" for e in found) or \
            "No emails found."

    @tool
    def read_email(id: int) -> str:
        """Read the email with this id."""
        email = mailbox.read(id)
        if email is None:
            return f"No email with id {id}."
        return f"From: {email.sender.split(' <')[0]}\nDate: {email.date}\nSubject: {email.subject}\n\n{email.body}"

    @tool
    def return_answer(answer: Annotated[str, Field(max_length=30)], source_id: int) -> str:
        """Give the final answer (a few words) and the id of the email it comes from."""
        return "Answer recorded."

    return [search_inbox, read_email, return_answer]


def closed_schema(tool: BaseTool) -> dict[str, Any]:
    """The tool's OpenAI schema with ``additionalProperties: false``: no arguments beyond its own.

    langchain adds that only with ``strict=True``, which also makes every optional argument required; the
    135M model, made to write ``sender``, ``after`` and ``before`` on every search, filled them with made-up
    names and dates that filtered out every email (probed), and ran past its tokens.
    """
    schema = convert_to_openai_tool(tool)
    schema["function"]["parameters"]["additionalProperties"] = False
    return schema


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def build_graph(mailbox: Mailbox, *, base_url: str = "http://127.0.0.1:9/v1", temperature: float = 1.0,
                max_tokens: int = 64) -> Any:
    """The compiled graph: ``agent`` (chat model with tools) <-> ``tools`` (ToolNode), until ``return_answer``.

    Args:
        mailbox: the inbox the tools search.
        base_url: the app's own OpenAI endpoint; during rollouts the calls go to the gateway instead.
        temperature: sampling temperature of the agent's model (1.0 explores, for training).
        max_tokens: per model call; the longest call (a search with its four arguments) fits in about 50.
    """
    tools = make_tools(mailbox)
    llm = ChatOpenAI(model=MODEL_NAME, base_url=base_url, api_key="unused", temperature=temperature)
    # Every turn is a tool call (the server constrains the reply to one, and closed schemas forbid invented
    # arguments); TURN_CHOICES says which tool, or "required" (any of them).
    schemas = [closed_schema(t) for t in tools]
    chats = [llm.bind_tools(schemas, tool_choice=choice, max_tokens=max_tokens) for choice in TURN_CHOICES]

    async def agent(state: State) -> dict[str, Any]:
        chat = chats[sum(isinstance(m, AIMessage) for m in state["messages"])]
        return {"messages": [await chat.ainvoke([SystemMessage(SYSTEM), *EXAMPLE, *state["messages"]])]}

    def after_agent(state: State) -> str:
        reply = state["messages"][-1]
        return "tools" if isinstance(reply, AIMessage) and reply.tool_calls else END  # a malformed call ends it

    def after_tools(state: State) -> str:
        answered = any(c["name"] == "return_answer" for c in _calls(state["messages"]))
        turns = sum(isinstance(m, AIMessage) for m in state["messages"])
        return END if answered or turns >= MAX_TURNS else "agent"

    graph = StateGraph(State)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools, handle_tool_errors=True))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", after_agent, ["tools", END])
    graph.add_conditional_edges("tools", after_tools, ["agent", END])
    return graph.compile()


def task_input(question: Question) -> dict[str, Any]:
    """The graph's input for one question."""
    return {"messages": [("user", question.text)]}


def _calls(messages: list[Any]) -> list[dict[str, Any]]:
    return [c for m in messages if isinstance(m, AIMessage) for c in m.tool_calls]


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def right_answer(expected: str, given: str) -> bool:
    """The expected words appear, in order and adjacent, in a short answer (``May 3`` in ``on May 3``, not
    in ``May 30``)."""
    want, got = _words(expected), _words(given)
    if not want or len(got) > MAX_ANSWER_WORDS:
        return False
    return any(got[i:i + len(want)] == want for i in range(len(got) - len(want) + 1))


_SCHEMAS = {"search_inbox": ({"keywords"}, {"keywords", "sender", "after", "before"}),
            "read_email": ({"id"}, {"id"}), "return_answer": ({"answer", "source_id"}, {"answer", "source_id"})}


def _valid(call: dict[str, Any]) -> bool:
    """A call to a known tool with its required arguments and no unknown ones."""
    schema = _SCHEMAS.get(call["name"])
    return schema is not None and schema[0] <= set(call["args"]) <= schema[1]


def grade(question: Question, messages: list[Any]) -> dict[str, float]:
    """What the run did: ``found``, ``read``, ``cited``, ``answered`` (each 0 or 1) and ``valid_tool_calls``."""
    calls = _calls(messages)
    invalid = sum(len(m.invalid_tool_calls) for m in messages if isinstance(m, AIMessage))
    results = {m.tool_call_id: m.content for m in messages if isinstance(m, ToolMessage)}
    found = any(c["name"] == "search_inbox" and re.search(rf"^id {question.source_id} \|",
                                                           str(results.get(c["id"], "")), re.M)
                for c in calls)
    read = any(c["name"] == "read_email" and c["args"].get("id") == question.source_id for c in calls)
    answers = [c["args"] for c in calls if c["name"] == "return_answer"]
    final = answers[0] if answers else {}
    made = len(calls) + invalid
    return {"found": float(found), "read": float(read),
            "cited": float(final.get("source_id") == question.source_id),
            "answered": float(right_answer(question.answer, str(final.get("answer", "")))),
            "valid_tool_calls": sum(map(_valid, calls)) / made if made else 0.0}


WEIGHTS = {"answered": 0.5, "cited": 0.2, "read": 0.2, "found": 0.1}


def reward(question: Question) -> Any:
    """The reward function for one question: ``fn(trajectory, final_state) -> float`` (see the module
    docstring); it also records the marks and ``success`` in ``trajectory.metrics``."""

    def score(trajectory: Trajectory, state: dict[str, Any] | None) -> float:
        marks = grade(question, (state or {}).get("messages", []))
        trajectory.metrics.update(marks)
        trajectory.metrics["success"] = marks["answered"] * marks["cited"]
        return sum(weight * marks[name] for name, weight in WEIGHTS.items())

    return score
