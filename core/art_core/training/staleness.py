"""How far behind the trainer each group was sampled, and which groups are too stale to train on.

**Staleness** of a group is the number of optimizer steps the adapter has moved since the group was sampled:

    staleness = policy_step - sampling_step

where ``policy_step`` is the checkpoint the module is at when the step starts (the one being trained from, so the
step writes ``policy_step + 1``), and ``sampling_step`` is the oldest ``adapter_step`` in the group's call records
(a group is as stale as its stalest call). In the synchronous loop (sample on checkpoint k, train step k+1) every
group has staleness 0; a pipeline that samples while step k+1 trains, then trains k+2 on those groups, has
staleness 1. The issue's "new step minus sampling step" is ``staleness + 1``.

``TrainConfig.max_off_policy`` bounds it: a group with staleness above the bound is dropped before any of its
tokens is read, and counted (``groups_stale``). A group whose calls carry no ``adapter_step`` (re-rendered
histories, records from elsewhere) has unknown staleness: it is kept, and counted in ``groups_staleness_unknown``.
A record newer than the module (a step the trainer never had, e.g. after restoring an older checkpoint) counts as
staleness 0.

This module reads only the records' step numbers: no torch, so the step runner can use it to warn at the caller.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ..types import TrajectoryGroup

__all__ = ["StaleGroupsWarning", "Staleness", "group_sampling_step", "staleness"]


class StaleGroupsWarning(UserWarning):
    """Some groups were sampled more steps ago than ``TrainConfig.max_off_policy`` allows and were dropped."""


def group_sampling_step(group: TrajectoryGroup) -> int | None:
    """The oldest adapter step any call of ``group`` was sampled by; None when no call says."""
    steps = [call.adapter_step for trajectory in group.trajectories for history in trajectory.histories()
             for call in history.calls if call.adapter_step is not None]
    return min(steps) if steps else None


@dataclass(frozen=True)
class Staleness:
    """The staleness of a step's groups against one bound (see the module docstring)."""

    per_group: list[int | None]
    """Each group's staleness, None where unknown."""
    stale: list[int]
    """Indices of the groups past the bound (to be dropped)."""
    bound: int | None

    def metrics(self) -> dict[str, float]:
        """``groups_stale``, ``staleness_mean``/``staleness_max`` over groups of known staleness (0 when none),
        and a histogram as scalars: ``groups_staleness_<k>`` for each staleness k seen, and
        ``groups_staleness_unknown``."""
        known = [s for s in self.per_group if s is not None]
        counts = Counter(known)
        out: dict[str, float] = {
            "groups_stale": float(len(self.stale)),
            "staleness_mean": sum(known) / len(known) if known else 0.0,
            "staleness_max": float(max(known, default=0)),
            "groups_staleness_unknown": float(len(self.per_group) - len(known)),
        }
        out.update({f"groups_staleness_{k}": float(n) for k, n in sorted(counts.items())})
        return out

    def message(self) -> str:
        """The warning's text for the dropped groups."""
        worst = max(self.per_group[i] or 0 for i in self.stale)
        return (f"{len(self.stale)} of {len(self.per_group)} group(s) were sampled more than max_off_policy="
                f"{self.bound} step(s) before the adapter they would train (staleness up to {worst}) and were "
                f"dropped (indices {self.stale[:10]}); train sooner after sampling, or raise max_off_policy")


def staleness(groups: Sequence[TrajectoryGroup], policy_step: int, bound: int | None) -> Staleness:
    """Each group's staleness against ``policy_step`` and the groups past ``bound`` (None: no bound)."""
    per_group: list[int | None] = []
    for group in groups:
        sampled = group_sampling_step(group)
        per_group.append(None if sampled is None else max(policy_step - sampled, 0))
    stale = [i for i, s in enumerate(per_group) if bound is not None and s is not None and s > bound]
    return Staleness(per_group, stale, bound)
