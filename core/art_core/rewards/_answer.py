"""Reading the judge's answer: JSON text in, one checked ``Judgement`` per trajectory label out.

Anything short of the exact shape asked for (not JSON, a label missing or unknown, a score that is not a
number in [0, 1], the wrong number of step scores) raises ``MalformedAnswer`` with a sentence that says
what was wrong; ``ruler.py`` sends that sentence back to the judge in a repair prompt.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from ._prompt import JudgePrompt

__all__ = ["Judgement", "MalformedAnswer", "parse_answer"]


class MalformedAnswer(ValueError):
    """The judge's answer does not have the shape asked for (internal: repaired, or turned into JudgeError)."""


@dataclass(frozen=True)
class Judgement:
    """The judge's verdict on one trajectory."""

    score: float
    """In [0, 1]."""
    explanation: str
    step_scores: tuple[float, ...] | None = None
    """One score in [0, 1] per assistant step of the trajectory's main history, when asked for."""


def parse_answer(text: str | None, prompt: JudgePrompt) -> dict[str, Judgement]:
    """Parse and check the judge's answer to ``prompt``.

    Returns:
        label -> judgement, for every label of the prompt.

    Raises:
        MalformedAnswer: the answer is not exactly the shape asked for (the message says how).
    """
    if not text or not text.strip():
        raise MalformedAnswer("the answer was empty")
    try:
        data = json.loads(_strip_fence(text))
    except json.JSONDecodeError as exc:
        raise MalformedAnswer(f"the answer is not valid JSON ({exc.msg} at character {exc.pos})") from exc
    if not isinstance(data, dict):
        raise MalformedAnswer(f"the answer is a JSON {type(data).__name__}, not an object keyed by trajectory id")
    missing = [label for label in prompt.labels if label not in data]
    if missing:
        raise MalformedAnswer(f"it scored {len(prompt.labels) - len(missing)} of {len(prompt.labels)} "
                              f"trajectories: {', '.join(missing)} missing")
    unknown = sorted(set(data) - set(prompt.labels))
    if unknown:
        raise MalformedAnswer(f"it has keys that are no trajectory id: {', '.join(unknown)}")
    judgements = {}
    for i, label in enumerate(prompt.labels):
        steps = prompt.step_counts[i] if prompt.step_counts is not None else None
        judgements[label] = _judgement(label, data[label], steps)
    return judgements


def _judgement(label: str, entry: Any, steps: int | None) -> Judgement:
    if not isinstance(entry, dict):
        raise MalformedAnswer(f"{label} is a JSON {type(entry).__name__}, not an object with explanation and score")
    score = _unit_number(entry.get("score"), f"{label}.score")
    explanation = entry.get("explanation", "")
    if not isinstance(explanation, str):
        raise MalformedAnswer(f"{label}.explanation is not a string")
    step_scores = None
    if steps is not None:
        raw = entry.get("step_scores")
        if not isinstance(raw, list) or len(raw) != steps:
            got = f"{len(raw)} step scores" if isinstance(raw, list) else "no step_scores list"
            raise MalformedAnswer(f"{label} has {got}, expected {steps} (one per step)")
        step_scores = tuple(_unit_number(v, f"{label}.step_scores[{k}]") for k, v in enumerate(raw))
    return Judgement(score, explanation.strip(), step_scores)


def _unit_number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedAnswer(f"{where} is {json.dumps(value)}, not a number from 0 to 1")
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise MalformedAnswer(f"{where} is {value}, outside 0 to 1")
    return float(value)


def _strip_fence(text: str) -> str:
    """Hosted judges without structured output sometimes wrap JSON in a Markdown fence: unwrap it."""
    text = text.strip()
    if text.startswith("```") and text.endswith("```") and "\n" in text:
        return text[text.index("\n") + 1:-3]
    return text
