"""The calculator's scripted expert: the teacher of ``--demos`` (see ``examples._expert``).

It stands in for a strong hosted model (a scripted expert): it reads the question of the conversation's last user
message ("What is 47 times 86?"), answers it with the right tool call (``multiply(a=47, b=86)``), and once the tool's
result is in, answers with it in the worked example's words ("47 times 86 is 4042."). Nothing else: the system
prompt and the worked exchange before the question are context, as they are for the trainable model.
"""

from __future__ import annotations

import re
from typing import Any

from .._expert import ScriptedExpert, ToolCall, message_text
from .agent import CalcTask

__all__ = ["EXPERT_NAME", "calculator_expert", "calculator_policy", "parse_question"]

EXPERT_NAME = "calculator-expert"

_QUESTION = re.compile(r"What is (\d+) (plus|times) (\d+)\?")


def parse_question(text: str) -> CalcTask:
    """The task a question asks ("What is 47 times 86?" -> ``CalcTask(47, "times", 86)``).

    Raises:
        ValueError: the text holds no calculator question.
    """
    match = _QUESTION.search(text)
    if match is None:
        raise ValueError(f"no question of the form 'What is A plus|times B?' in {text[:80]!r}")
    return CalcTask(int(match[1]), match[2], int(match[3]))


def calculator_policy(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> ToolCall | str:
    """The right tool call for the last question, or, once its result came back, the answer carrying it.

    Raises:
        ValueError: no user message holds a question, or the tool it needs is not offered.
    """
    asked = [k for k, m in enumerate(messages) if m.get("role") == "user"]
    if not asked:
        raise ValueError("the conversation has no user message")
    task = parse_question(message_text(messages[asked[-1]]))
    results = [m for m in messages[asked[-1] + 1:] if m.get("role") == "tool"]  # the worked example's come before
    if not results:
        offered = {str(t.get("function", {}).get("name")) for t in tools}
        if task.tool not in offered:
            raise ValueError(f"the question needs the tool {task.tool!r}, and the request offers {sorted(offered)}")
        return ToolCall(task.tool, {"a": task.a, "b": task.b})
    return f"{task.a} {task.operation} {task.b} is {message_text(results[-1]).strip()}."


def calculator_expert() -> ScriptedExpert:
    """The expert, to serve with ``async with calculator_expert() as expert:``."""
    return ScriptedExpert(calculator_policy, name=EXPERT_NAME)
