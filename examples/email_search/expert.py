"""The email agent's scripted expert: the teacher of ``--demos`` (see ``examples._expert``).

It stands in for a strong hosted model (a scripted expert), one that would find the answer by reading the inbox.
To stay a few lines, it knows the answer instead: it is given the example's seeded mailbox and looks the question
up among ``mailbox.questions``. Its turns follow the path the agent's graph asks for (``agent.TURN_CHOICES``) in the
worked exchange's form (``agent.EXAMPLE``):

1. ``search_inbox(keywords="<event> <colleague>")`` ("budget review Omar": the source email ranks first);
2. ``read_email(id=<the source email>)``, once a search listed it;
3. ``return_answer(answer=<the answer>, source_id=<the source email>)``, once it was read.

Only the turns after the conversation's last user message count: the worked exchange before it is context.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .._expert import Policy, ScriptedExpert, ToolCall, message_text
from .mailbox import Mailbox, Question

__all__ = ["EXPERT_NAME", "email_expert", "email_policy", "search_keywords"]

EXPERT_NAME = "email-expert"

_QUESTION = re.compile(r"(?:When|Where) is the (.+) with (\w+)\?")


def search_keywords(question: Question) -> str:
    """The words the expert searches for: the event and the colleague (``When is the offsite with Dana?`` ->
    ``offsite Dana``), as the worked exchange searches ``design review Zoe``.

    Raises:
        ValueError: the question is not of the mailbox's form ``When|Where is the <event> with <name>?``.
    """
    match = _QUESTION.fullmatch(question.text)
    if match is None:
        raise ValueError(f"not a question of the form 'When|Where is the <event> with <name>?': {question.text!r}")
    return f"{match[1]} {match[2]}"


def _turns(messages: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], str]]:
    """The agent's calls after the last user message: ``(tool name, arguments, the tool's result)``."""
    last_user = max(k for k, m in enumerate(messages) if m.get("role") == "user")
    results = {m.get("tool_call_id"): message_text(m) for m in messages[last_user:] if m.get("role") == "tool"}
    turns = []
    calls = [c for m in messages[last_user:] if m.get("role") == "assistant" for c in m.get("tool_calls") or []]
    for call in calls:
        function = call.get("function", {})
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except json.JSONDecodeError as exc:
            raise ValueError(f"the arguments of {function.get('name')!r} are not JSON: {exc}") from exc
        turns.append((str(function.get("name")), arguments, results.get(call.get("id"), "")))
    return turns


def email_policy(mailbox: Mailbox) -> Policy:
    """The policy for questions about ``mailbox``: search, read the source, answer citing it (see the module).

    The returned ``policy(messages, tools)`` raises ``ValueError`` when the last user message is not one of the
    mailbox's questions, or when a search of the conversation did not list the source email.
    """
    questions = {q.text: q for q in mailbox.questions}

    def policy(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> ToolCall:
        asked = [m for m in messages if m.get("role") == "user"]
        if not asked:
            raise ValueError("the conversation has no user message")
        text = message_text(asked[-1]).strip()
        question = questions.get(text)
        if question is None:
            raise ValueError(f"{text[:80]!r} is not a question about this mailbox")
        turns = _turns(messages)
        if any(name == "read_email" and args.get("id") == question.source_id for name, args, _ in turns):
            return ToolCall("return_answer", {"answer": question.answer, "source_id": question.source_id})
        listed = re.compile(rf"^id {question.source_id} \|", re.MULTILINE)
        if any(name == "search_inbox" and listed.search(result) for name, _, result in turns):
            return ToolCall("read_email", {"id": question.source_id})
        if any(name == "search_inbox" for name, _, _ in turns):
            raise ValueError(f"the search did not list email {question.source_id}, the source of {text!r}")
        return ToolCall("search_inbox", {"keywords": search_keywords(question)})

    return policy


def email_expert(mailbox: Mailbox) -> ScriptedExpert:
    """The expert for ``mailbox``'s questions, to serve with ``async with email_expert(mailbox) as expert:``."""
    return ScriptedExpert(email_policy(mailbox), name=EXPERT_NAME)
