"""Read a JSONL file of OpenAI-format chats (the format OpenAI's fine-tuning API takes) as trajectories.

Each non-blank line is one example::

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                   "function": {"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "..."},
                  {"role": "assistant", "content": "...", "weight": 1}],
     "tools": [{"type": "function", "function": {"name": "search", "parameters": {...}}}]}

The whole file is checked before anything else happens, and every problem found (up to ``MAX_PROBLEMS``) is
reported at once with its line number, so a user fixes a file in one pass instead of one error per run.
The checks are the ones that would otherwise surface deep inside a training step: roles, content shapes,
tool-call ids and JSON arguments, tool results answering a call made earlier in the same chat, calls to
tools the example declares (in trained turns: a ``"weight": 0`` turn is context, such as another agent's handoff
call before this agent took over, and may call a tool this example does not offer), and at least one assistant
turn to learn from.

An assistant message may carry OpenAI's ``"weight": 0`` (keep the turn as context, do not train on it) or
``1``; it stays on the message for the SFT step to read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..types import Message, Trajectory

__all__ = ["ChatFileError", "MAX_PROBLEMS", "read_chat_file"]

#: At most this many problems are listed; the message says how many more there were.
MAX_PROBLEMS = 20

_ROLES = ("system", "developer", "user", "assistant", "tool")
_EXAMPLE_KEYS = {"messages", "tools", "parallel_tool_calls"}


class ChatFileError(ConfigError):
    """A chat file that cannot be trained on; ``problems`` holds one ``"line N: ..."`` string per problem."""

    def __init__(self, path: Path, problems: list[str], total: int) -> None:
        more = f"\n  ... and {total - len(problems)} more" if total > len(problems) else ""
        super().__init__(f"{path}: {total} problem(s) in the chat file; fix them and run again:\n  "
                         + "\n  ".join(problems) + more)
        self.path = path
        self.problems = problems
        self.total = total


def read_chat_file(path: str | Path) -> list[Trajectory]:
    """Every example of ``path`` as a :class:`Trajectory` (messages and tools; no token ids, no reward).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ChatFileError: any line is not a well-formed example (the message lists each with its line number),
            or the file holds no example at all.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"chat file {path} does not exist (expected a .jsonl file, one chat per line)")
    trajectories: list[Trajectory] = []
    problems: list[str] = []
    for number, line in _lines(path):
        found = [f"line {number}: {problem}" for problem in _check_line(line)]
        if found:
            problems.extend(found)
            continue
        example = json.loads(line)
        trajectories.append(Trajectory(
            messages=[Message.model_validate(m) for m in example["messages"]],
            tools=list(example.get("tools") or []),
            metadata={"source": f"{path.name}:{number}"},
        ))
    if not trajectories and not problems:
        problems.append("the file holds no example (every line is blank)")
    if problems:
        raise ChatFileError(path, problems[:MAX_PROBLEMS], len(problems))
    return trajectories


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with path.open(encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if line.strip():
                yield number, line


def _check_line(line: str) -> list[str]:
    try:
        example = json.loads(line)
    except json.JSONDecodeError as exc:
        return [f"not valid JSON ({exc.msg} at character {exc.pos})"]
    if not isinstance(example, dict):
        return [f"a JSON {type(example).__name__}, not an object with \"messages\""]
    if "functions" in example:
        return ['"functions" is the legacy format: declare tools as "tools": [{"type": "function", ...}]']
    problems = [f"unknown key {key!r} (an example holds {', '.join(sorted(_EXAMPLE_KEYS))})"
                for key in example if key not in _EXAMPLE_KEYS]
    tool_names, tool_problems = _check_tools(example.get("tools"))
    problems += tool_problems
    messages = example.get("messages")
    if not isinstance(messages, list) or not messages:
        return [*problems, '"messages" must be a non-empty list of chat messages']
    problems += _check_messages(messages, tool_names)
    return problems


def _check_tools(tools: Any) -> tuple[set[str] | None, list[str]]:
    """The declared tool names (None when the example declares none) and the problems of the declarations."""
    if tools is None:
        return None, []
    if not isinstance(tools, list):
        return None, ['"tools" must be a list of {"type": "function", "function": {...}}']
    names, problems = set(), []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            problems.append(f'tools[{i}] is not {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}')
        elif not isinstance(function.get("name"), str) or not function["name"]:
            problems.append(f"tools[{i}].function has no name")
        elif "parameters" in function and not isinstance(function["parameters"], dict):
            problems.append(f"tools[{i}].function.parameters must be a JSON schema object")
        else:
            names.add(function["name"])
    return names, problems


def _check_messages(messages: list[Any], tool_names: set[str] | None) -> list[str]:
    problems: list[str] = []
    call_ids: set[str] = set()
    unanswered: dict[str, str] = {}  # the last assistant turn's call ids still without a tool result -> its place
    trained_turns = 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            problems.append(f"{where} is a JSON {type(message).__name__}, not a message object")
            continue
        role = message.get("role")
        if role not in _ROLES:
            problems.append(f"{where} has role {role!r}; use one of {', '.join(_ROLES)}")
            continue
        where = f"{where} ({role})"
        problems += _check_content(message, where)
        if role in ("user", "assistant"):  # a call is answered before the conversation goes on (OpenAI's rule)
            problems += [f"{at} tool call {call_id!r} has no tool result before {where}: add a "
                         f'{{"role": "tool", "tool_call_id": {json.dumps(call_id)}, "content": ...}} message after it'
                         for call_id, at in unanswered.items()]
            unanswered = {}
        if role == "assistant" and i == 0 and message.get("weight", 1) == 1:
            problems.append(f"{where} is the first message, with nothing before it to prompt it: start with a user "
                            "(or system) message, or give it weight 0")
        if role == "assistant":
            made = set(call_ids)
            # a context turn (weight 0) may call a tool this example does not offer: another agent's, before a handoff
            offered = tool_names if message.get("weight", 1) != 0 else None
            problems += _check_calls(message.get("tool_calls"), where, offered, call_ids)
            unanswered = {call_id: where for call_id in call_ids - made}
            weight = message.get("weight", 1)
            if weight not in (0, 1) or isinstance(weight, bool):
                problems.append(f"{where} has weight {weight!r}; use 0 (context only) or 1 (trained)")
            elif weight == 1:
                trained_turns += 1
        elif "weight" in message:
            problems.append(f"{where} has a weight; only assistant messages are weighted")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in call_ids:
                problems.append(f"{where} answers tool_call_id {call_id!r}, which no earlier assistant turn made")
            if isinstance(call_id, str):
                unanswered.pop(call_id, None)
    if not trained_turns:
        problems.append("no assistant message to learn from (add one, or give one weight 1)")
    return problems


def _check_content(message: dict[str, Any], where: str) -> list[str]:
    content = message.get("content")
    if content is None:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            return []
        return [f"{where} has no content"]
    if isinstance(content, str):
        return []
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return []
    return [f"{where} content must be a string or a list of {{\"type\": \"text\", \"text\": ...}} parts"]


def _check_calls(calls: Any, where: str, tool_names: set[str] | None, call_ids: set[str]) -> list[str]:
    if calls is None:
        return []
    if not isinstance(calls, list) or not calls:
        return [f"{where} tool_calls must be a non-empty list"]
    problems = []
    for k, call in enumerate(calls):
        at = f"{where} tool_calls[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("id"), str) or not isinstance(function, dict):
            problems.append(f'{at} is not {{"id": ..., "type": "function", "function": {{"name", "arguments"}}}}')
            continue
        if call["id"] in call_ids:
            problems.append(f"{at} reuses the id {call['id']!r} of an earlier call: give each call its own id")
        call_ids.add(call["id"])
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not name:
            problems.append(f"{at} has no function name")
        elif tool_names is not None and name not in tool_names:
            problems.append(f"{at} calls {name!r}, which the example's tools do not declare")
        if not isinstance(arguments, str):
            problems.append(f"{at} arguments must be a JSON string, e.g. \"{{\\\"q\\\": 1}}\"")
            continue
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError as exc:
            problems.append(f"{at} arguments are not valid JSON ({exc.msg} at character {exc.pos})")
            continue
        if not isinstance(parsed, dict):
            problems.append(f"{at} arguments must be a JSON object, not a {type(parsed).__name__}")
    return problems
