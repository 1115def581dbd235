"""Custom rewards: plain functions of (trajectory, final state), weighted, optionally beside RULER.

    def correct(trajectory, state) -> float:          # sync or async, returns a number
        return float(state["answer"] == state["expected"])

    scored = await score_group(group, {"correct": correct}, final_states=states)
    scored = await score_group(group, {"correct": correct}, weights={"correct": 0.5, "ruler": 0.5},
                               final_states=states, ruler=partial(ruler_score_group, judge="openai/o4-mini"))

Each component's value lands in the trajectory's ``metrics`` under its name (RULER's as ``ruler_score``),
and the reward becomes the weighted sum of the components. The reward a trajectory came with is kept as
``metrics["reward_before_rewards"]``. Like ``ruler_score_group``, it returns a scored copy: the input
group is never modified, so an error leaves every reward as it was.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeAlias

from ..errors import ConfigError, RewardError
from ..types import Trajectory, TrajectoryGroup
from ._tasks import gather_or_cancel

__all__ = ["GroupScorer", "RewardFn", "reward_value", "score_group"]

RewardFn: TypeAlias = Callable[[Trajectory, Any], float | Awaitable[float]]
"""A reward component: ``fn(trajectory, final_state) -> float``, sync or async."""

GroupScorer: TypeAlias = Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup | None]]
"""Scores a whole group into a copy with ``metrics["ruler_score"]``, e.g. ``partial(ruler_score_group, judge=...)``."""

RULER = "ruler"
"""The component name RULER's score goes by in ``weights``."""


async def score_group(
    group: TrajectoryGroup,
    rewards: Mapping[str, RewardFn],
    *,
    weights: Mapping[str, float] | None = None,
    final_states: Sequence[Any] | None = None,
    ruler: GroupScorer | None = None,
) -> TrajectoryGroup | None:
    """Compute each reward component for every trajectory, and set the reward to their weighted sum.

    Args:
        group: the trajectories to score.
        rewards: component name -> ``fn(trajectory, final_state)`` (sync or async) returning a finite number.
            Async ones run concurrently. Each value is stored as ``metrics[name]``.
        weights: component name -> weight; a component not named here weighs 1.0. Names may be those of
            ``rewards``, and ``"ruler"`` when ``ruler`` is given. The reward is ``sum(weight * value)``,
            not normalised.
        final_states: one object per trajectory, in group order, passed as each function's second argument
            (your agent's final state, the environment...). Default: each trajectory's ``final_state`` (what
            the adapters keep there: a graph's final state, an agent's final output; None otherwise).
        ruler: a group scorer run beside the functions, usually ``functools.partial(ruler_score_group,
            judge=...)``; its ``ruler_score`` is the ``"ruler"`` component, and its metrics and logs are kept.

    Returns:
        A scored copy of the group; None only when ``ruler`` returned None (a judge failure it swallowed).

    Raises:
        ConfigError: a weight names no component, a component is named ``"ruler"`` while ``ruler`` is given,
            or ``final_states`` has the wrong length.
        RewardError: the group is empty, or a function raised or returned something other than a finite
            number (the message names the component and the trajectory).
        JudgeError: from ``ruler``, unless it swallows its errors.
    """
    _check_arguments(group, rewards, weights, final_states, ruler)
    if not group.trajectories:
        raise RewardError("the group has no trajectories: nothing to score")
    states = list(final_states) if final_states is not None else [t.final_state for t in group]

    # The functions and the judge run concurrently; the first error cancels the rest.
    results = await gather_or_cancel([_component_values(group, rewards, states),
                                      *([ruler(group)] if ruler is not None else [])])
    values: dict[str, list[float]] = results[0]  # name -> one value per trajectory
    base = group
    if ruler is not None:
        judged = results[1]
        if judged is None:
            return None
        if len(judged) != len(group) or any("ruler_score" not in t.metrics for t in judged):
            raise RewardError("the ruler scorer returned a group that does not match the input (each trajectory "
                              "needs metrics['ruler_score']): pass partial(ruler_score_group, judge=...)")
        base = judged
        values[RULER] = [float(t.metrics["ruler_score"]) for t in judged]

    scored = base.model_copy(deep=True)
    weights = dict(weights or {})
    for i, (original, trajectory) in enumerate(zip(group.trajectories, scored.trajectories, strict=True)):
        metrics = dict(trajectory.metrics)
        metrics["reward_before_rewards"] = original.reward
        for name, per_trajectory in values.items():
            if name != RULER:  # RULER's own metrics already hold ruler_score
                metrics[name] = per_trajectory[i]
        trajectory.metrics = metrics
        # Which metrics are reward components (for reports and Langfuse scores); RULER's is metrics["ruler_score"].
        trajectory.metadata = {**trajectory.metadata, "reward_components": ",".join(values)}
        trajectory.reward = sum(weights.get(name, 1.0) * per_trajectory[i] for name, per_trajectory in values.items())
    return scored


async def reward_value(fn: RewardFn, trajectory: Trajectory, state: Any) -> float:
    """``fn(trajectory, state)``, awaited when it is async, checked to be a finite number.

    Raises:
        RewardError: ``fn`` returned something other than a finite number.
        Exception: whatever ``fn`` raised, unchanged (callers decide whether it ends the group).
    """
    value = fn(trajectory, state)
    if inspect.isawaitable(value):
        value = await value
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        value = value.item()  # a NumPy scalar (np.float32, np.int64, np.bool_) or a 0-d array or tensor
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise _NotANumber(f"returned {value!r} for trajectory {trajectory.id!r}: return a finite number")
    return float(value)


class _NotANumber(RewardError):
    """A reward function's value was not a finite number (the message starts with "returned ...")."""


async def _component_values(group: TrajectoryGroup, rewards: Mapping[str, RewardFn],
                            states: list[Any]) -> dict[str, list[float]]:
    async def one(name: str, fn: RewardFn, trajectory: Trajectory, state: Any) -> float:
        try:
            return await reward_value(fn, trajectory, state)
        except _NotANumber as exc:
            raise RewardError(f"reward {name!r} {exc}") from None
        except Exception as exc:
            raise RewardError(f"reward {name!r} failed on trajectory {trajectory.id!r}: "
                              f"{type(exc).__name__}: {exc}") from exc

    names = list(rewards)
    pairs = list(zip(group.trajectories, states, strict=True))
    # One flat set of calls, so that the first error cancels every other one (a nested gather would not).
    flat = await gather_or_cancel(one(name, rewards[name], t, s) for name in names for t, s in pairs)
    return {name: flat[k * len(pairs):(k + 1) * len(pairs)] for k, name in enumerate(names)}


def _check_arguments(group: TrajectoryGroup, rewards: Mapping[str, RewardFn], weights: Mapping[str, float] | None,
                     final_states: Sequence[Any] | None, ruler: GroupScorer | None) -> None:
    problems = []
    known = set(rewards) | ({RULER} if ruler is not None else set())
    if ruler is not None and RULER in rewards:
        problems.append(f"a reward is named {RULER!r} while ruler= is given: rename it")
    for name, fn in rewards.items():
        if not callable(fn):
            problems.append(f"reward {name!r} is a {type(fn).__name__}, not a function")
    for name, weight in (weights or {}).items():
        if name not in known:
            problems.append(f"weights name {name!r}, which is no component (components: {sorted(known)})")
        elif isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            problems.append(f"weight of {name!r} is {weight!r}: use a finite number")
    if not known:
        problems.append("no reward components: pass rewards={name: fn}, or ruler=")
    if final_states is not None and len(final_states) != len(group):
        problems.append(f"final_states has {len(final_states)} entries for a group of {len(group)}: pass one per "
                        "trajectory, in group order")
    if problems:
        raise ConfigError("score_group: " + "; ".join(problems))
