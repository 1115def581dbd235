"""A stale group's advantages, centred on what the current policy expects rather than on what was sampled.

GRPO centres each group's rewards on the group's mean: the reward the policy that *sampled* it expected on the
task. A stale group (``staleness.py``) was sampled by an older adapter; if the steps since then taught the adapter
to prefer the group's better answers, the current policy already expects more than that mean, and advantages
centred on the old mean tell the step to push again where the steps before already pushed. Fresh data would show
that push (more good answers in the group, a higher mean); stale data cannot.

The gateway records the sampler's log-prob of every token, so the current policy's expected reward on the task
can be estimated from the group's own answers by self-normalised importance weighting:

    w_i = softmax_i( sum over trajectory i's trained tokens of  log pi(y_t) - log pi_sampler(y_t) )
    b   = sum_i w_i A_i          (A_i: the trajectory's advantage, centred on the sampled mean)
    A_i <- A_i - b

``b`` is in advantage units: the current policy's expected reward minus the sampled mean (divided by the
group's scale when the advantages are). Being a convex combination of the group's own advantages it stays within
their range, however far apart the two policies are: no weight explodes. A fresh group gets ``b = 0`` (every
weight 1, centred advantages). The estimate is consistent, not unbiased (self-normalised).

The weights need the current log-probs of every trajectory of the group. When a group's samples all lie in one
micro-batch (a group within ``TrainConfig.micro_batch_tokens``, the common case), they come from that
micro-batch's own forward pass at no extra cost; a group spread over several micro-batches (over the budget: long
agent turns, large groups) has them from a forward pass without gradient before the step (``GRPOTrainer._accumulate``),
except on ranks of an FSDP-sharded trainer, where every forward pass is a collective all ranks must join in step:
there such a group keeps its sampled mean (``groups_recentred`` counts the groups that were re-centred).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .batching import MicroBatch, PackedGroups, PrefixGroup
from .samples import Sample

__all__ = ["StaleBaselines", "row_log_weights"]


def row_log_weights(mb: MicroBatch, logprobs: torch.Tensor) -> torch.Tensor:
    """``[B]`` each row's log pi/pi_behaviour summed over its trained tokens whose behaviour log-prob is known
    (0 for a fresh row). ``logprobs``: ``[B, T]`` the current policy's, detached."""
    if mb.behaviour_logprobs is None:
        return torch.zeros(logprobs.shape[0], device=logprobs.device, dtype=logprobs.dtype)
    behaviour = mb.behaviour_logprobs.to(logprobs.device, logprobs.dtype)
    known = (mb.trained.to(logprobs.device) > 0) & ~torch.isnan(behaviour)
    # where before the subtraction's use: NaN (unknown behaviour, padding) must not reach the sum
    return torch.where(known, logprobs - torch.nan_to_num(behaviour), 0.0).sum(dim=-1)


class StaleBaselines:
    """The re-centring of one step's stale groups (module docstring).

    Built from the step's samples and micro-batch plan (``extra_pass=False``: no forward pass may be added, and
    the groups that would need one are left as sampled); ``split`` names the stale groups whose weights need a
    forward pass of their own (``add_log_weights`` takes what it gives); ``advantages`` re-centres a micro-batch's
    advantages. ``shifts`` keeps each stale group's ``b`` (device tensors: read them after the step's sync).
    """

    def __init__(self, samples: Sequence[Sample], plan: Sequence[PrefixGroup | PackedGroups], *,
                 extra_pass: bool = True) -> None:
        stale = {s.group_index for s in samples if s.behaviour_logprobs is not None}
        self._trajectories: dict[int, list[str]] = {  # stale group -> its trajectories, in order
            g: list(dict.fromkeys(s.trajectory_id for s in samples if s.group_index == g)) for g in stale}
        self._advantage = {(s.group_index, s.trajectory_id): s.advantage for s in samples
                           if s.group_index in self._trajectories}
        homes: dict[int, set[int]] = {}  # stale group -> the micro-batches (by id) holding its samples
        for pg in plan:
            for mb in pg.micro_batches:
                for s in mb.samples:
                    if s.group_index in self._trajectories:
                        homes.setdefault(s.group_index, set()).add(id(mb))
        self.split = {g for g, mbs in homes.items() if len(mbs) > 1}
        """Stale groups spread over several micro-batches: their weights come from ``add_log_weights``."""
        if not extra_pass:  # no forward pass of their own (FSDP ranks): those groups keep their sampled mean
            for group in self.split:
                del self._trajectories[group]
            self.split = set()
        self._log_weight: dict[tuple[int, str], torch.Tensor] = {}
        self._baseline: dict[int, torch.Tensor] = {}
        self.shifts: list[torch.Tensor] = []

    def __bool__(self) -> bool:
        return bool(self._trajectories)

    def add_log_weights(self, mb: MicroBatch, logprobs: torch.Tensor) -> None:
        """Take the log-weights of ``mb``'s rows of split groups from a forward pass (``logprobs`` ``[B, T]``,
        detached); a trajectory's rows add up."""
        self._add_log_weights(mb, logprobs, self.split)

    def advantages(self, mb: MicroBatch, logprobs: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` ``mb``'s advantages with each stale group's ``b`` taken off its trained tokens; the others
        as they are. ``logprobs``: ``[B, T]`` this micro-batch's current log-probs (detached)."""
        advantages = mb.advantages.to(logprobs.device)
        groups = {s.group_index for s in mb.samples if s.group_index in self._trajectories}
        if not groups:
            return advantages
        local = groups - self.split
        if local:  # every sample of these groups is in this micro-batch: their weights come from its forward
            self._add_log_weights(mb, logprobs, local)
        zero = torch.zeros((), device=logprobs.device, dtype=advantages.dtype)
        shift = torch.stack([self._group_baseline(s.group_index) if s.group_index in groups else zero
                             for s in mb.samples])  # [B], one copy rather than one per row
        trained = mb.trained.to(logprobs.device) > 0
        return torch.where(trained, advantages - shift[:, None], advantages)

    def _add_log_weights(self, mb: MicroBatch, logprobs: torch.Tensor, groups: set[int]) -> None:
        rows = row_log_weights(mb, logprobs)
        for i, s in enumerate(mb.samples):
            if s.group_index in groups:
                key = (s.group_index, s.trajectory_id)
                self._log_weight[key] = self._log_weight[key] + rows[i] if key in self._log_weight else rows[i]

    def _group_baseline(self, group: int) -> torch.Tensor:
        if group not in self._baseline:
            ids = self._trajectories[group]
            log_w = torch.stack([self._log_weight[(group, t)] for t in ids])
            advantages = torch.tensor([self._advantage[(group, t)] for t in ids], dtype=log_w.dtype,
                                      device=log_w.device)
            baseline = (torch.softmax(log_w, dim=0) * advantages).sum()
            self._baseline[group] = baseline
            self.shifts.append(baseline)
        return self._baseline[group]
