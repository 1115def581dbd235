"""A step's report, built from what ``model.train`` already has: the backend's metrics and the groups."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..types import TRACE_ID_KEY, Trajectory, TrajectoryGroup
from ._base import ScoredRollout, StepReport, TrajectoryRow

__all__ = ["TRACE_URL_KEY", "step_report"]

TRACE_URL_KEY = "langfuse_trace_url"
"""``Trajectory.metadata`` key of a link to the rollout's trace, copied into the table when present."""

_MESSAGES_CHARS = 4000  # a table cell: enough to read a rollout, small enough for every tracker's UI


def step_report(step: int, metrics: Mapping[str, Any], groups: Sequence[TrajectoryGroup], *,
                seconds: Mapping[str, float], failures: int, config: dict[str, Any] | None = None) -> StepReport:
    """The report of one ``train`` call.

    Args:
        step: the model's step after the call.
        metrics: the backend's step metrics (``history.jsonl``'s row): each finite number becomes ``train/<key>``
            (``time/<phase>`` for ``seconds_<phase>``).
        groups: the step's groups: their trajectories' metrics are averaged into ``rollout/<key>_mean``, and the
            best and worst trajectories make the table.
        seconds: client-side timings, logged as ``time/<key>``.
        failures: tracker failures before this report is sent, logged as ``tracking/failures``.
        config: the run's configuration when it changed since the last report; None when it did not.
    """
    out: dict[str, float] = {}
    for key, value in metrics.items():
        number = _finite(value)
        if number is not None:  # the trainer's phase timings (seconds_forward_backward...) go beside the client's
            out[f"time/{key.removeprefix('seconds_')}" if key.startswith("seconds_") else f"train/{key}"] = number
    trajectories = [t for g in groups for t in g.trajectories]
    for key, mean in _trajectory_means(trajectories).items():
        out[f"rollout/{key}_mean"] = mean
    completion_tokens = [sum(len(c.completion_token_ids) for h in t.histories() for c in h.calls) for t in trajectories]
    if completion_tokens:
        out["rollout/completion_tokens_mean"] = sum(completion_tokens) / len(completion_tokens)
    for key, value in seconds.items():
        out[f"time/{key}"] = float(value)
    out["tracking/failures"] = float(failures)
    rollouts = [ScoredRollout(trajectory_id=t.id, reward=t.reward, metadata=dict(t.metadata),
                              metrics={k: n for k, v in t.metrics.items() if (n := _finite(v)) is not None})
                for t in trajectories]
    return StepReport(step=step, metrics=out, trajectories=_best_and_worst(step, groups), rollouts=rollouts,
                      config=config)


def _finite(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def _trajectory_means(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Means of the numbers trajectories carry in ``metrics`` (``success``, reward components...), each over the
    trajectories that have it."""
    sums: dict[str, list[float]] = {}
    for t in trajectories:
        for key, value in t.metrics.items():
            number = _finite(value)
            if number is not None:
                sums.setdefault(key, []).append(number)
    return {key: sum(values) / len(values) for key, values in sums.items()}


def _best_and_worst(step: int, groups: Sequence[TrajectoryGroup]) -> list[TrajectoryRow]:
    ranked = [(t.reward, gi, t) for gi, g in enumerate(groups) for t in g.trajectories]
    if not ranked:
        return []
    best = max(ranked, key=lambda r: r[0])
    worst = min(ranked, key=lambda r: r[0])
    chosen = [("best", best)] if best[2] is worst[2] else [("best", best), ("worst", worst)]
    return [TrajectoryRow(step=step, label=label, group=gi, trajectory_id=t.id, reward=reward,
                          messages=_as_text(t), trace_id=_str_or_none(t.metadata.get(TRACE_ID_KEY)),
                          trace_url=_str_or_none(t.metadata.get(TRACE_URL_KEY)))
            for label, (reward, gi, t) in chosen]


def _as_text(trajectory: Trajectory) -> str:
    parts = []
    for message in trajectory.messages:
        text = message.text()
        if message.tool_calls:
            text += "".join(f"\n-> {c.function.name}({c.function.arguments})" for c in message.tool_calls)
        parts.append(f"{message.role}: {text}")
    text = "\n\n".join(parts)
    return text if len(text) <= _MESSAGES_CHARS else text[:_MESSAGES_CHARS] + " [...]"


def _str_or_none(value: Any) -> str | None:
    return str(value) if value else None
