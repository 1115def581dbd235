"""What a training step optimises: the pluggable part of ``GRPOTrainer.train_step``.

The step's loop is the same whatever is learned: records -> samples -> micro-batches -> forward and backward
-> one optimizer step -> metrics. An ``Objective`` supplies the two things that differ:

- ``weigh(groups)``: how much each trajectory's tokens count, from the rewards alone, before any token is read.
  GRPO weighs a trajectory by its group-relative advantage and drops groups whose rewards are all equal (they
  teach nothing, and a dropped group's records are never turned into samples).
- ``__call__(inputs)``: the loss of one micro-batch, ``LossInputs -> LossOutput`` (normalised step-wide, so the
  micro-batch losses of one step add up to the step's loss).

``GRPOObjective`` (the group-relative policy losses of ``losses.py``, with their clipping, truncated importance
sampling and KL penalty) is the first one. ``SFTObjective`` (supervised fine-tuning: the negative log-likelihood
of the assistant's tokens, every trajectory kept with weight 1) is the second, through the same loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..config import TrainConfig
from ..types import TrajectoryGroup
from .advantages import AdvantageScale, compute_group_advantages
import torch

from .losses import Loss, LossInputs, LossOutput, build_loss

__all__ = ["GRPOObjective", "Objective", "SFTObjective", "Weights"]


@dataclass(frozen=True)
class Weights:
    """What an objective makes of a step's groups.

    Attributes:
        per_group: one entry per group, in order: one weight per trajectory (GRPO: its advantage, put on every
            token it sampled), or None for a group the step drops.
        dropped: the indices of the dropped groups (the step warns about them: ``ZeroVarianceGroupsWarning``).
    """

    per_group: list[list[float] | None]
    dropped: list[int]


@runtime_checkable
class Objective(Protocol):
    """The advantage/loss part of a training step.

    Example (the default one, as ``train_step`` builds it from its ``TrainConfig``)::

        objective = GRPOObjective.from_config(TrainConfig(loss="cispo"))
        trainer.train_step(groups, config, objective=objective)
    """

    name: str
    """Names the loss in errors ("the dapo loss is nan on micro-batch 3")."""
    reference: bool
    """Whether the loss needs the base model's log-probs (``LossInputs.ref_logprobs``): a forward pass more."""

    def weigh(self, groups: Sequence[TrajectoryGroup]) -> Weights:
        """Each trajectory's weight, from the groups' rewards; groups it drops get None."""
        ...

    def __call__(self, inputs: LossInputs) -> LossOutput:
        """The loss of one micro-batch."""
        ...


@dataclass(frozen=True)
class GRPOObjective:
    """Group-relative policy optimisation: advantages within each group, and one of ``losses.py``'s losses.

    Args:
        loss: the micro-batch loss (``build_loss``): GRPO, Dr. GRPO, DAPO, GSPO or CISPO.
        name: the loss's name, for errors.
        scale: what the centred rewards are divided by (``compute_group_advantages``).
        reference: whether the loss has a KL term (``beta > 0``) and needs the base model's log-probs.
    """

    loss: Loss
    name: str
    scale: AdvantageScale
    reference: bool = False

    @classmethod
    def from_config(cls, config: TrainConfig) -> GRPOObjective:
        """The objective ``config`` describes (its ``loss``, ``loss_options``, ``beta``, ``tis_cap``, scale).

        Raises:
            ConfigError: the loss refuses an option or a value (the message names it and lists the accepted ones).
        """
        loss = build_loss(config.loss, beta=config.beta, tis_cap=config.tis_cap, **config.loss_options)
        return cls(loss=loss, name=config.loss, scale=config.advantage_scale or loss.default_advantage_scale,
                   reference=config.beta > 0)

    def weigh(self, groups: Sequence[TrajectoryGroup]) -> Weights:
        advantages = compute_group_advantages([g.rewards for g in groups], scale=self.scale)
        return Weights(per_group=advantages.advantages, dropped=advantages.dropped_groups)

    def __call__(self, inputs: LossInputs) -> LossOutput:
        return self.loss(inputs)


@dataclass(frozen=True)
class SFTObjective:
    """Supervised fine-tuning: the negative log-likelihood of the trained (assistant) tokens.

    Every trajectory weighs 1 and no group is dropped (rewards are ignored: the data is taken as good). The loss
    of a micro-batch is ``-sum(mask * log pi) / num_tokens``, where ``num_tokens`` counts the trained tokens of
    the whole optimizer step, so the micro-batch losses add up to the step's token-mean NLL (the cross-entropy
    a causal-LM trainer reports, over the assistant tokens only).
    """

    name: str = "sft"
    reference: bool = False

    def weigh(self, groups: Sequence[TrajectoryGroup]) -> Weights:
        return Weights(per_group=[[1.0] * len(g.trajectories) for g in groups], dropped=[])

    def __call__(self, inputs: LossInputs) -> LossOutput:
        keep = inputs.mask > 0  # [B, T]
        # where, not a product: masked positions may hold NaN (padding), and NaN * 0 is NaN
        logprobs = torch.where(keep, inputs.logprobs, torch.zeros_like(inputs.logprobs))  # [B, T]
        nll_sum = -logprobs.sum()
        loss = nll_sum / max(inputs.num_tokens, 1)
        return LossOutput(loss=loss, stats={"tokens": keep.sum().float(), "nll_sum": nll_sum.detach()})
