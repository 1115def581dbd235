"""Group-relative advantages: how much better each trajectory did than its siblings.

GRPO (Shao et al. 2024, DeepSeekMath, Sec. 4.1.2) needs no value model: it samples several
trajectories for the same task and uses each one's reward, centred on the group's mean, as the
advantage of every token it produced. The three ``scale`` options differ only in what the centred
reward is divided by:

    "group"  A_i = (r_i - mean(group)) / (std(group) + eps)   GRPO, DeepSeekMath
    "batch"  A_i = (r_i - mean(group)) / (std(batch) + eps)   Lite PPO ("Tricks or Traps", Liu et al. 2025)
    "none"   A_i =  r_i - mean(group)                          Dr. GRPO (Liu et al. 2025)

Dr. GRPO argues that dividing by the group's std up-weights questions that are nearly always
solved or nearly always failed (their std is small); Lite PPO keeps the group mean but takes the
std over the whole batch, which keeps the advantages on a stable scale without that per-question
bias. All stds are population stds (divide by n), as in the papers' formulas.

A group whose rewards are all equal has advantage 0 for every trajectory: it carries no learning
signal, only cost, so it is dropped (DAPO's "dynamic sampling" makes the same observation). This
module is pure: it returns which groups were dropped and leaves warning about it to the trainer.

This module imports nothing heavy (no torch), so rewards can be checked before any model loads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from ..errors import ConfigError, TrajectoryError

__all__ = ["AdvantageScale", "GroupAdvantages", "ZeroVarianceGroupsWarning", "compute_group_advantages"]


class ZeroVarianceGroupsWarning(UserWarning):
    """Some groups had equal rewards for every trajectory: they carry no signal and were dropped."""


AdvantageScale = Literal["group", "batch", "none"]
"""What the centred rewards are divided by: the group's std, the batch's std, or nothing."""

_SCALES: tuple[str, ...] = get_args(AdvantageScale)

# Two rewards closer than this count as equal. Rewards are usually O(1) scores; a spread this small
# is float noise, and dividing by it (scale="group") would blow noise up into huge advantages.
_EQUAL_TOLERANCE = 1e-8


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages for a batch of groups, plus what was dropped and summary statistics.

    Attributes:
        advantages: One entry per input group, in input order: a list with one advantage per
            trajectory (in the group's order), or ``None`` for a dropped group.
        dropped_groups: Indices of the groups whose rewards are all equal (within 1e-8),
            including single-trajectory groups. Their entry in ``advantages`` is ``None``.
        reward_mean: Mean reward over every trajectory, kept or dropped, or NaN when there are
            none. Taken over all trajectories because it is the number to log as training
            progress: a batch where every group scores 1.0 is all dropped but is the best batch.
        reward_std: Population std of the same rewards, or NaN when there are none.
        scale_std: The std the kept groups' centred rewards were divided by when
            ``scale="batch"`` (population std over the kept trajectories); NaN for the other
            scales or when no group was kept.
    """

    advantages: list[list[float] | None]
    dropped_groups: list[int]
    reward_mean: float
    reward_std: float
    scale_std: float

    @property
    def num_kept(self) -> int:
        """Number of groups that carry a learning signal."""
        return len(self.advantages) - len(self.dropped_groups)


def compute_group_advantages(
    rewards: Sequence[Sequence[float]],
    *,
    scale: AdvantageScale = "group",
    eps: float = 1e-6,
) -> GroupAdvantages:
    """Compute group-relative advantages, dropping groups with zero reward variance.

    Args:
        rewards: One sequence of rewards per group (one reward per trajectory). Groups may have
            different sizes.
        scale: ``"group"`` (default; GRPO as in DeepSeekMath, the baseline the other variants are
            measured against), ``"batch"`` (Lite PPO) or ``"none"`` (Dr. GRPO). Each loss names
            the scale its paper used as ``default_advantage_scale``.
        eps: Added to the std before dividing. Default 1e-6 keeps a group whose rewards barely
            differ from producing huge advantages, while being far below the spread of any real
            reward. Must be finite and >= 0; 0 is safe because groups with no spread are dropped
            before any division.

    Returns:
        A ``GroupAdvantages``. An empty ``rewards`` gives empty lists and NaN statistics.

    Raises:
        ConfigError: ``scale`` is not one of "group", "batch", "none", or ``eps`` is negative or
            not finite.
        TrajectoryError: A group is empty, or a reward is NaN or infinite. The message names the
            group (and trajectory) index.
    """
    if scale not in _SCALES:
        raise ConfigError(f"unknown advantage scale {scale!r}: use one of {', '.join(map(repr, _SCALES))}")
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ConfigError(f"eps must be a finite number >= 0, got {eps!r}")

    groups = [_checked_group(g, group_rewards) for g, group_rewards in enumerate(rewards)]

    # A single trajectory has max == min, so it is dropped here too: it has no sibling to compare with.
    kept = [g for g, group in enumerate(groups) if max(group) - min(group) > _EQUAL_TOLERANCE]
    dropped = sorted(set(range(len(groups))) - set(kept))

    scale_std = math.nan
    if scale == "batch" and kept:
        scale_std = _population_std([r for g in kept for r in groups[g]])

    advantages: list[list[float] | None] = [None] * len(groups)
    for g in kept:
        group = groups[g]
        mean = math.fsum(group) / len(group)
        if scale == "group":
            divisor = _population_std(group) + eps
        elif scale == "batch":
            divisor = scale_std + eps
        else:  # "none"
            divisor = 1.0
        advantages[g] = [(r - mean) / divisor for r in group]

    every_reward = [r for group in groups for r in group]
    return GroupAdvantages(
        advantages=advantages,
        dropped_groups=dropped,
        reward_mean=math.fsum(every_reward) / len(every_reward) if every_reward else math.nan,
        reward_std=_population_std(every_reward) if every_reward else math.nan,
        scale_std=scale_std,
    )


def _checked_group(index: int, group_rewards: Sequence[float]) -> list[float]:
    """Return the group's rewards as floats, or raise naming the empty group or bad reward."""
    group = [float(r) for r in group_rewards]
    if not group:
        raise TrajectoryError(
            f"group {index} has no rewards: drop empty groups before computing advantages, "
            "or check whether all of its rollouts failed"
        )
    for t, reward in enumerate(group):
        if not math.isfinite(reward):
            raise TrajectoryError(
                f"group {index}, trajectory {t} has a non-finite reward {reward!r}: "
                "fix the reward function or drop that trajectory"
            )
    return group


def _population_std(values: list[float]) -> float:
    """Population std (divide by n) of a non-empty list."""
    mean = math.fsum(values) / len(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
