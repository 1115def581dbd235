"""Pick the rollouts worth imitating: the best of each group, or those above a reward (rejection sampling).

Rejection-sampling fine-tuning (RFT, "expert iteration") trains with plain SFT on the agent's own best runs:
sample a group per task, keep the winners, fine-tune on them. The choice is one call here so that a loop can
switch between GRPO on the whole group and SFT on its winners without reshaping its data.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import ConfigError
from ..types import Trajectory, TrajectoryGroup

__all__ = ["select_for_sft"]


def select_for_sft(groups: Iterable[TrajectoryGroup], *, best_per_group: int | None = 1,
                   min_reward: float | None = None) -> list[Trajectory]:
    """The trajectories of ``groups`` to fine-tune on, best first within each group.

    Args:
        groups: scored groups (``reward`` set on every trajectory).
        best_per_group: keep at most this many of each group, highest reward first (ties keep the group's
            order); None keeps every trajectory that passes ``min_reward``.
        min_reward: keep only trajectories whose reward is at least this; None keeps any reward.

    Returns:
        Deep copies, so marking or re-scoring them leaves the groups as they were. Empty when nothing passes:
        the caller decides whether an empty round is an error.

    Raises:
        ConfigError: ``best_per_group`` is below 1.
    """
    if best_per_group is not None and best_per_group < 1:
        raise ConfigError(f"best_per_group is {best_per_group}: keep at least 1 per group, or pass None for all")
    chosen: list[Trajectory] = []
    for group in groups:
        ranked = sorted(group.trajectories, key=lambda t: -t.reward)  # sorted() is stable: ties keep their order
        if min_reward is not None:
            ranked = [t for t in ranked if t.reward >= min_reward]
        if best_per_group is not None:
            ranked = ranked[:best_per_group]
        chosen += [t.model_copy(deep=True) for t in ranked]
    return chosen
