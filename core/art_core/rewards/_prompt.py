"""What the RULER judge reads: the group rendered once, in a given order, and the JSON schema of its answer.

The judge gets two messages. The system message says how to judge; the user message holds, in order:

    <shared_context>   messages every trajectory starts with, shown once (system prompt, task...)
    <tools>            the tool schemas, once when every trajectory was offered the same ones
    <trajectory id="trajectory_1">   the rest of each run (and its additional histories), one per run
    <rubric>           what a good run looks like
    the answer format  one entry per trajectory id: an explanation, then a score in [0, 1]

Messages are rendered one JSON object per line (role, content, tool calls, tool call id): unambiguous for
the judge, and identical messages render identically, which is how the shared prefix is found. Labels are
positions (``trajectory_1`` is whatever run was put first), so the caller's shuffle decides who is first.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..types import History, Message, Trajectory

__all__ = ["DEFAULT_RUBRIC", "JudgePrompt", "build_judge_prompt", "repair_message", "shared_prefix_length"]

DEFAULT_RUBRIC = """\
- A trajectory that achieves the user's goal scores higher than one that does not.
- Partial progress toward the goal earns partial credit; no progress, or a harmful action, scores near 0.
- Among trajectories that reach the goal, prefer the correct, complete and efficient ones (no needless \
steps or tool calls).
- Penalise wrong claims, invented tool results, ignored instructions and errors left unhandled.
- Use the whole range: a run that fully succeeds should score near 1."""
"""The rubric used when ``ruler_score_group`` gets none: goal first, then quality, then efficiency."""

SYSTEM_PROMPT = """\
You are an impartial judge of an AI agent. You are shown {n} trajectories: independent attempts by the \
agent at the same task, starting from the same context (shown once). Read them all, compare them, and \
score each from 0 to 1 following the rubric. Scores are relative: a better trajectory scores higher than a \
worse one, and only attempts of equal quality get equal scores. The order and the numbering of the \
trajectories mean nothing. Answer with a JSON object only, no other text."""


@dataclass(frozen=True)
class JudgePrompt:
    """One judge request: its messages, the schema its answer must follow, and how to read the answer."""

    messages: list[dict[str, Any]]
    """System and user message, OpenAI chat format."""
    schema: dict[str, Any]
    """JSON schema of the answer: one ``{"explanation", "score"[, "step_scores"]}`` object per label."""
    labels: list[str]
    """``trajectory_1``... in the order shown; ``labels[i]`` names the i-th trajectory given."""
    step_counts: list[int] | None
    """Per label, how many step scores the answer must hold (``None``: no step scores asked for)."""
    shared_prefix: int
    """How many leading messages were shown once, as the shared context."""


def build_judge_prompt(
    trajectories: Sequence[Trajectory],
    *,
    rubric: str,
    step_rewards: bool = False,
    explanation_max_chars: int | None = 300,
) -> JudgePrompt:
    """Render ``trajectories`` (already in the order the judge should see them) into one judge request.

    Args:
        trajectories: the group's runs, in display order; the i-th is labelled ``trajectory_{i+1}``.
        rubric: what a good run looks like.
        step_rewards: also ask for one score per assistant message ("step") of each run's main history.
            The shared context then stops before the first assistant message, so every step is in a run's
            own part and is numbered there (``"step": 1``...).
        explanation_max_chars: ``maxLength`` of each explanation in the schema (bounds what a constrained
            local judge writes); ``None`` leaves it unbounded.

    Returns:
        The request and what is needed to read its answer.
    """
    rendered = [[render_message(m) for m in t.messages] for t in trajectories]
    prefix = shared_prefix_length(rendered, stop_at_assistant=step_rewards)
    labels = [f"trajectory_{i + 1}" for i in range(len(trajectories))]
    tools = [t.tools for t in trajectories]
    same_tools = all(ts == tools[0] for ts in tools)

    parts: list[str] = []
    if prefix:
        parts.append(_block("shared_context", _lines(rendered[0][:prefix])))
    if same_tools and tools[0]:
        parts.append(_block("tools", json.dumps(tools[0], ensure_ascii=False)))
    step_counts = []
    for label, trajectory, messages in zip(labels, trajectories, rendered, strict=True):
        remainder = messages[prefix:]
        steps = 0
        if step_rewards:
            for message in remainder:
                if message["role"] == "assistant":
                    steps += 1
                    message["step"] = steps  # shown to the judge: step_scores[k-1] scores "step": k
        step_counts.append(steps)
        inner = [_lines(remainder) or "(no further messages)"]
        if not same_tools and trajectory.tools:
            inner.insert(0, _block("tools", json.dumps(trajectory.tools, ensure_ascii=False)))
        inner += [_history_block(k, history, trajectory.tools)
                  for k, history in enumerate(trajectory.additional_histories, start=1)]
        parts.append(f'<trajectory id="{label}">\n' + "\n".join(inner) + "\n</trajectory>")
    parts.append(_block("rubric", rubric.strip()))
    parts.append(_answer_format(labels, step_rewards, explanation_max_chars))

    messages = [
        {"role": "system", "content": SYSTEM_PROMPT.format(n=len(trajectories))},
        {"role": "user", "content": "\n\n".join(parts)},
    ]
    schema = answer_schema(labels, step_counts if step_rewards else None, explanation_max_chars)
    return JudgePrompt(messages, schema, labels, step_counts if step_rewards else None, prefix)


#: The scores a constrained judge may write: 0, 0.01, ..., 0.99, 1 (see ``answer_schema``).
SCORE_GRID: list[float] = [0, *(round(k / 100, 2) for k in range(1, 100)), 1]


def answer_schema(labels: Sequence[str], step_counts: Sequence[int] | None,
                  explanation_max_chars: int | None) -> dict[str, Any]:
    """The JSON schema of the judge's answer: an object with exactly one entry per label, in order.

    Every property is required and no other is allowed (the subset strict structured-output APIs accept);
    the explanation's ``maxLength`` and the score grid bind constrained decoders (our gateway, vLLM), and every
    answer is checked here anyway (``_answer.py``, which takes any number from 0 to 1 from judges that ignore
    the schema). Scores are the hundredths from 0 to 1, one ``enum`` under ``$defs``: a plain ``number`` has no
    length bound in JSON schema, and a small judge held to one at temperature 0 can write ``0.1223333...``
    until the token limit cuts the answer (seen with the embedded model judging itself).
    """
    properties = {}
    for i, label in enumerate(labels):
        explanation: dict[str, Any] = {"type": "string"}
        if explanation_max_chars is not None:
            explanation["maxLength"] = explanation_max_chars
        entry: dict[str, Any] = {
            "type": "object",
            "properties": {"explanation": explanation, "score": {"$ref": "#/$defs/score"}},
            "required": ["explanation", "score"],
            "additionalProperties": False,
        }
        if step_counts is not None:
            entry["properties"]["step_scores"] = {
                "type": "array", "items": {"$ref": "#/$defs/score"},
                "minItems": step_counts[i], "maxItems": step_counts[i],
            }
            entry["required"].append("step_scores")
        properties[label] = entry
    return {"type": "object", "properties": properties, "required": list(labels), "additionalProperties": False,
            "$defs": {"score": {"enum": SCORE_GRID}}}


def repair_message(problem: str, prompt: JudgePrompt) -> dict[str, Any]:
    """The user message sent after a malformed answer: what was wrong, and the exact shape wanted."""
    steps = ', and "step_scores" (one number from 0 to 1 per step, in step order)' if prompt.step_counts else ""
    return {"role": "user", "content": (
        f"Your answer could not be used: {problem}. Answer again with only a JSON object whose keys are exactly "
        f"{', '.join(prompt.labels)}; each value is an object with \"explanation\" (a short string) and "
        f"\"score\" (a number from 0 to 1, at most two decimals){steps}. No other text."
    )}


def shared_prefix_length(rendered: Sequence[Sequence[dict[str, Any]]], *, stop_at_assistant: bool = False) -> int:
    """How many leading messages every trajectory shares, leaving each at least one message of its own.

    Args:
        rendered: each trajectory's messages, as ``render_message`` writes them.
        stop_at_assistant: end the prefix before the first assistant message (for step scores).
    """
    if not rendered:
        return 0
    limit = min(len(messages) for messages in rendered) - 1  # every run keeps something to be judged on
    n = 0
    while n < limit and all(messages[n] == rendered[0][n] for messages in rendered):
        if stop_at_assistant and rendered[0][n]["role"] == "assistant":
            break
        n += 1
    return max(n, 0)


def render_message(message: Message) -> dict[str, Any]:
    """The parts of a message a judge needs: role, text (non-text parts as placeholders), tool calls."""
    out: dict[str, Any] = {"role": message.role}
    if isinstance(message.content, list):
        out["content"] = [part if part.get("type") == "text" else {"type": part.get("type", "unknown")}
                          for part in message.content]  # an image's base64 would only cost tokens
    elif message.content is not None:
        out["content"] = message.content
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                             for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _history_block(index: int, history: History, main_tools: list[dict[str, Any]]) -> str:
    inner = []
    if history.tools and history.tools != main_tools:
        inner.append(_block("tools", json.dumps(history.tools, ensure_ascii=False)))
    inner.append(_lines([render_message(m) for m in history.messages]) or "(empty)")
    return f'<additional_history index="{index}">\n' + "\n".join(inner) + "\n</additional_history>"


def _answer_format(labels: Sequence[str], step_rewards: bool, explanation_max_chars: int | None) -> str:
    entry = '{"explanation": "...", "score": 0.0' + (', "step_scores": [...]' if step_rewards else "") + "}"
    example = "{" + ", ".join(f'"{label}": {entry}' for label in labels) + "}"
    limit = f" (at most {explanation_max_chars} characters)" if explanation_max_chars is not None else ""
    steps = (' "step_scores" holds one score from 0 to 1 per numbered step of that trajectory, in order.'
             if step_rewards else "")
    return (f"Answer with this JSON object, one entry per trajectory: {example}\n"
            f"Write the explanation first{limit}, then the score from 0 (worst) to 1 (best), at most two decimals.{steps}")


def _lines(messages: Sequence[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(m, ensure_ascii=False) for m in messages)


def _block(tag: str, body: str) -> str:
    return f"<{tag}>\n{body}\n</{tag}>"
