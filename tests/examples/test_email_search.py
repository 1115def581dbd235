"""The email_search example's parts: the seeded mailbox, its tools on a real SQLite FTS5 database, the reward.

The end-to-end run (graph -> real adapter -> gateway -> one GRPO step) is in ``test_examples_smoke.py``.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

from art_core import Trajectory
from art_core.errors import ConfigError
from examples.email_search import split_questions
from examples.email_search.agent import grade, make_tools, reward, right_answer
from examples.email_search.mailbox import EVENTS, Mailbox, Question


@pytest.fixture(scope="module")
def mailbox() -> Mailbox:
    return Mailbox(seed=0)


def test_mailbox_is_deterministic_per_seed(mailbox):
    again = Mailbox(seed=0)
    assert again.all() == mailbox.all() and again.questions == mailbox.questions
    assert Mailbox(seed=1).all() != mailbox.all()
    assert mailbox.size == 300 and len(mailbox.questions) == 100


def test_each_answer_sits_in_exactly_one_email(mailbox):
    emails = mailbox.all()
    for question in mailbox.questions:
        first = question.text.rstrip("?").split()[-1]
        event = next(e for e in EVENTS if f" {e} " in question.text)
        about = [e for e in emails if e.sender.startswith(first + " ") and event in e.body]
        assert [e.id for e in about] == [question.source_id], question
        assert question.answer in about[0].body


def test_search_ranks_the_source_first_and_filters(mailbox):
    search, read, _ = make_tools(mailbox)
    question = mailbox.questions[0]
    source = mailbox.read(question.source_id)
    keywords = question.text.replace("When is the ", "").replace("Where is the ", "").replace(" with", "")
    lines = search.invoke({"keywords": keywords}).splitlines()
    assert 1 <= len(lines) <= 3
    assert lines[0] == f"id {source.id} | {source.date} | {source.sender.split(' <')[0]} | {source.subject}"
    # sender narrows to that person's emails; a date window that excludes the source drops it
    first = source.sender.split()[0]
    assert all(f"| {first} " in line for line in search.invoke({"keywords": keywords, "sender": first}).splitlines())
    later = search.invoke({"keywords": keywords, "after": "2026-12-01"})
    assert later == "No emails found."
    window = search.invoke({"keywords": keywords, "after": source.date, "before": "2027-01-01"})
    assert window.splitlines()[0].startswith(f"id {source.id} |")
    with pytest.raises(ValidationError, match="pattern"):  # the schema the model sees already forbids it
        search.invoke({"keywords": keywords, "after": "March 1"})
    with pytest.raises(ValueError, match="after must be a date like 2026-03-01"):
        mailbox.search(keywords, after="March 1")
    assert search.invoke({"keywords": "?!"}).startswith("Error: keywords must contain")
    # FTS5 syntax in the keywords is searched as plain words, not parsed
    assert search.invoke({"keywords": 'offsite" OR NEAR(x'}).startswith("id ")
    text = read.invoke({"id": source.id})
    assert question.answer in text and text.startswith(f"From: {source.sender.split(' <')[0]}\n")
    assert read.invoke({"id": 99_999}) == "No email with id 99999."


def test_tool_schemas_are_closed_and_short(mailbox):
    from examples.email_search.agent import closed_schema

    search, read, answer = (closed_schema(t)["function"]["parameters"] for t in make_tools(mailbox))
    assert search["additionalProperties"] is False and search["required"] == ["keywords"]
    assert search["properties"]["keywords"]["maxLength"] == 40
    assert answer["required"] == ["answer", "source_id"] and answer["properties"]["source_id"]["type"] == "integer"
    assert read["properties"]["id"]["type"] == "integer"


def test_right_answer_matches_words_in_a_short_answer():
    assert right_answer("May 3", "on May 3") and right_answer("Room 4B", "room 4b.")
    assert not right_answer("May 3", "May 30") and not right_answer("May 3", "May")
    assert not right_answer("May 3", "the offsite is on May 3 please put it in your calendar")


def _run(question: Question, mailbox: Mailbox, *, keywords: str, read: int | None, answer: str,
         source: int) -> list:
    """A run's messages as the graph builds them, tool results from the real tools."""
    search_tool, read_tool, _ = make_tools(mailbox)
    messages = [HumanMessage(question.text),
                AIMessage("", tool_calls=[{"name": "search_inbox", "args": {"keywords": keywords}, "id": "c0"}]),
                ToolMessage(search_tool.invoke({"keywords": keywords}), tool_call_id="c0")]
    if read is not None:
        messages += [AIMessage("", tool_calls=[{"name": "read_email", "args": {"id": read}, "id": "c1"}]),
                     ToolMessage(read_tool.invoke({"id": read}), tool_call_id="c1")]
    messages += [AIMessage("", tool_calls=[{"name": "return_answer", "args": {"answer": answer, "source_id": source},
                                            "id": "c2"}]),
                 ToolMessage("Answer recorded.", tool_call_id="c2")]
    return messages


def _score(question: Question, messages: list) -> tuple[float, dict[str, float]]:
    trajectory = Trajectory(messages=[{"role": "user", "content": question.text}])
    value = reward(question)(trajectory, {"messages": messages})
    return round(value, 3), trajectory.metrics


def test_reward_gives_partial_credit(mailbox):
    q = mailbox.questions[0]
    good = q.text.split(" the ", 1)[1].replace(" with", "").rstrip("?")  # e.g. "offsite Kofi"
    other = next(x for x in mailbox.questions if x.source_id != q.source_id)

    # the whole job: found (0.1) + read (0.2) + cited (0.2) + answered (0.5)
    score, marks = _score(q, _run(q, mailbox, keywords=good, read=q.source_id, answer=q.answer, source=q.source_id))
    assert score == 1.0 and marks["success"] == 1.0 and marks["valid_tool_calls"] == 1.0
    # found and read the right email, cited it, but answered wrongly: 0.1 + 0.2 + 0.2
    score, marks = _score(q, _run(q, mailbox, keywords=good, read=q.source_id, answer="no idea", source=q.source_id))
    assert score == 0.5 and marks["success"] == 0.0
    # found it, then read and cited another email: 0.1
    score, _ = _score(q, _run(q, mailbox, keywords=good, read=other.source_id, answer="x", source=other.source_id))
    assert score == 0.1
    # a right answer without its source: 0.1 (found) + 0.5; success needs the source too
    score, marks = _score(q, _run(q, mailbox, keywords=good, read=None, answer=q.answer, source=other.source_id))
    assert score == 0.6 and marks["success"] == 0.0
    # a search that misses (the id in the results is the other email's) and nothing else: 0
    score, _ = _score(q, _run(q, mailbox, keywords="lunch noodle", read=None, answer="x", source=0))
    assert score == 0.0


def test_malformed_calls_lower_valid_tool_calls(mailbox):
    q = mailbox.questions[0]
    messages = [HumanMessage(q.text),
                AIMessage("", tool_calls=[{"name": "search_inbox", "args": {"query": "x"}, "id": "c0"}]),
                ToolMessage("Error", tool_call_id="c0"),
                AIMessage("", invalid_tool_calls=[{"name": "read_email", "args": "{id: ", "id": "c1", "error": "json"}])]
    marks = grade(q, messages)
    assert marks["valid_tool_calls"] == 0.0 and marks["found"] == 0.0 and marks["answered"] == 0.0
    assert grade(q, [])["valid_tool_calls"] == 0.0


def test_training_and_held_out_questions_are_disjoint(mailbox):
    train, held_out = split_questions(mailbox, train=16, held_out=16)
    assert len(train) == 16 and len(held_out) == 16 and not set(train) & set(held_out)
    with pytest.raises(ConfigError, match="the mailbox has 100 questions"):
        split_questions(mailbox, train=90, held_out=20)
