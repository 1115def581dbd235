"""Policy losses for group-relative RL on LoRA adapters: one small class per published variant.

Every loss takes one micro-batch as ``LossInputs`` and returns ``LossOutput``. The variants differ
in two things only, and each class's docstring says which choice its paper made:

    what is clipped           the token ratio (GRPO, Dr. GRPO, DAPO), the sequence ratio (GSPO),
                              or only the detached IS weight in front of log pi (CISPO)
    what the sum is divided   sequences, each by its own length (GRPO); a constant budget
    by                        (Dr. GRPO); tokens in the step (DAPO, CISPO); sequences (GSPO)

Two corrections are shared by all of them and written once below:

    truncated importance sampling   the inference engine (vLLM, llama.cpp) samples with slightly
                                    different numerics than the trainer, so samples are mildly
                                    off-policy even "on-policy"; each token's loss is weighted by
                                    min(pi_old / pi_sampler, cap) (Yao et al. 2025)
    KL penalty to the base model    beta * k3(pi_ref || pi), off by default

A stale sequence (sampled n - 1 steps before the one training) may carry ``trust_steps = n``: the clipping losses
then compound their range over those steps, ``[(1 - eps_low)^n, (1 + eps_high)^n]`` (CISPO's cap is a variance
bound, not a trust region, and stays as it is).

Normalisers are step-wide (``num_sequences``, ``num_tokens`` count the whole optimizer step), so
the losses of one step's micro-batches add up to the step's loss and gradient accumulation is a
plain sum of ``backward()`` calls. Stats are sums for the same reason.

Masked positions (prompt, tool output, padding) may hold anything finite or NaN; they are replaced
with neutral values by ``torch.where`` before any arithmetic, because ``NaN * 0`` is NaN and because
``where`` alone does not protect the backward pass (the gradient of ``exp`` at an unselected huge
value is ``0 * inf = NaN``).

Maturity: each loss is checked against hand-computed values and gradients in
``tests/training/test_losses.py``; none has yet been compared end to end with a reference trainer.
The loss value itself is not comparable across variants (CISPO's is ``-A * log pi``, the others'
``-r * A``): compare runs on reward, not on loss.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

from ..errors import ConfigError
from .advantages import AdvantageScale

__all__ = [
    "LOSSES",
    "CISPOLoss",
    "DAPOLoss",
    "DrGRPOLoss",
    "GRPOLoss",
    "GSPOLoss",
    "Loss",
    "LossInputs",
    "LossOutput",
    "build_loss",
]


# --------------------------------------------------------------------------------------------
# Inputs, outputs, contract
# --------------------------------------------------------------------------------------------


@dataclass
class LossInputs:
    """One micro-batch: B sequences of T positions, all float32 tensors on one device.

    Attributes:
        logprobs: ``[B, T]`` log-prob of each target token under the current policy; carries grad.
        old_logprobs: ``[B, T]`` log-probs under the policy the samples are attributed to (no
            grad). With one optimizer step per batch the trainer passes ``logprobs.detach()``: the
            ratio is 1 in value but its gradient is that of ``logprobs``.
        advantages: ``[B, T]`` per-token advantage (the trajectory's advantage on each of its tokens).
        mask: ``[B, T]`` 1.0 where the model sampled the token and it is trained on, else 0.0.
        num_sequences: Sequences in the whole optimizer step (all micro-batches): a normaliser.
        num_tokens: ``mask.sum()`` over the whole optimizer step: a normaliser.
        sampler_logprobs: ``[B, T]`` log-probs the inference engine reported, NaN where unknown;
            ``None`` turns truncated importance sampling off.
        ref_logprobs: ``[B, T]`` log-probs under the base model (adapter disabled); needed when
            ``beta > 0``, and used for the ``kl_sum`` stat whenever given.
        trust_steps: ``[B]`` how many optimizer steps each sequence's clip range spans, at least 1: the
            clipping losses clip its ratio to ``[(1 - eps_low)^n, (1 + eps_high)^n]``. The trainer passes
            ``1 + staleness`` for samples trained against an older sampler
            (``TrainConfig.off_policy_trust_region="compounded"``). ``None``: one step for every sequence.
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    num_sequences: int
    num_tokens: int
    sampler_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    trust_steps: Tensor | None = None


@dataclass
class LossOutput:
    """What a loss returns for one micro-batch.

    Attributes:
        loss: Scalar, already divided by the step-wide normaliser: the micro-batch losses of one
            step sum to the step loss.
        stats: Detached 0-dim float tensors over masked tokens only. Sums, to add across
            micro-batches: ``tokens``, ``clipped_tokens``, ``ratio_sum``, ``kl_sum`` (0 without
            ``ref_logprobs``), ``is_weight_sum``, ``is_truncated_tokens``. Extremes, to combine with
            max / min: ``ratio_max`` and ``ratio_min`` (-inf / +inf when the micro-batch has no
            masked token, so they combine correctly).
    """

    loss: Tensor
    stats: dict[str, Tensor]


@runtime_checkable
class Loss(Protocol):
    """What the trainer needs from a loss: call it on a micro-batch, and know its advantage scale.

    Example::

        loss_fn = build_loss("dapo", epsilon_high=0.3)
        scale = loss_fn.default_advantage_scale          # "group"
        out = loss_fn(inputs)                           # inputs: LossInputs
        out.loss.backward()
    """

    default_advantage_scale: ClassVar[AdvantageScale]

    def __call__(self, inputs: LossInputs) -> LossOutput: ...


# --------------------------------------------------------------------------------------------
# Shared pieces: input checks, masking, truncated IS, KL, clipped surrogate, stats
# --------------------------------------------------------------------------------------------


class _Tokens(NamedTuple):
    """A micro-batch with every masked position replaced by a neutral value."""

    keep: Tensor  # [B, T] bool, True where the token is trained on
    count: Tensor  # [B] masked tokens per sequence, float
    logprobs: Tensor  # [B, T] 0 where masked; carries grad
    log_ratio: Tensor  # [B, T] logprobs - old_logprobs, 0 where masked; carries grad
    advantages: Tensor  # [B, T] 0 where masked
    is_weight: Tensor  # [B, T] truncated IS weight, detached; 1 where masked or unknown
    is_truncated: Tensor  # [B, T] bool, raw IS weight above the cap (masked tokens False)
    kl: Tensor  # [B, T] k3 estimate of KL(pi || pi_ref), 0 where masked or without ref; carries grad


def _prepare(inputs: LossInputs, *, beta: float, tis_cap: float | None) -> _Tokens:
    """Check the inputs and build the masked, neutral-filled tensors every loss starts from."""
    _check_inputs(inputs, beta=beta)
    keep = inputs.mask != 0  # [B, T]
    logprobs = torch.where(keep, inputs.logprobs, 0.0)  # [B, T]
    old = torch.where(keep, inputs.old_logprobs.detach(), 0.0)  # [B, T]
    is_weight, is_truncated = _truncated_is_weight(keep, old, inputs.sampler_logprobs, tis_cap)
    return _Tokens(
        keep=keep,
        count=keep.sum(dim=-1).to(logprobs.dtype),  # [B]
        logprobs=logprobs,
        log_ratio=logprobs - old,
        advantages=torch.where(keep, inputs.advantages.detach(), 0.0),
        is_weight=is_weight,
        is_truncated=is_truncated,
        kl=_k3_kl(keep, logprobs, inputs.ref_logprobs),
    )


def _check_inputs(inputs: LossInputs, *, beta: float) -> None:
    """Raise ConfigError for mismatched shapes, bad normalisers, or beta > 0 without ref log-probs."""
    tensors = {
        "logprobs": inputs.logprobs,
        "old_logprobs": inputs.old_logprobs,
        "advantages": inputs.advantages,
        "mask": inputs.mask,
        "sampler_logprobs": inputs.sampler_logprobs,
        "ref_logprobs": inputs.ref_logprobs,
    }
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    want = shapes["logprobs"]
    if len(want) != 2 or 0 in want or any(shape != want for shape in shapes.values()):
        got = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ConfigError(f"LossInputs tensors must all have the same non-empty [B, T] shape, got {got}")
    batch = want[0]
    steps = inputs.trust_steps  # its values are not read here: that would wait for the device
    if steps is not None and tuple(steps.shape) != (batch,):
        raise ConfigError(f"trust_steps must be a [B] = ({batch},) tensor of step counts (1 + each sequence's "
                          f"staleness), got shape {tuple(steps.shape)}: pass None for one step each")
    if not _is_int(inputs.num_sequences) or inputs.num_sequences < batch:
        raise ConfigError(
            f"num_sequences must be an int counting every sequence of the optimizer step (>= this "
            f"micro-batch's {batch}), got {inputs.num_sequences!r}"
        )
    if not _is_int(inputs.num_tokens) or inputs.num_tokens < 1:
        raise ConfigError(
            f"num_tokens must be a positive int (mask.sum() over the whole optimizer step), "
            f"got {inputs.num_tokens!r}: skip steps with no trainable token"
        )
    if beta > 0 and inputs.ref_logprobs is None:
        raise ConfigError(
            f"beta={beta} adds a KL penalty to the base model but LossInputs.ref_logprobs is None: "
            "pass ref_logprobs (log-probs with the adapter disabled) or set beta=0"
        )


def _truncated_is_weight(
    keep: Tensor, old_logprobs: Tensor, sampler_logprobs: Tensor | None, cap: float | None
) -> tuple[Tensor, Tensor]:
    """Per-token weight min(pi_old / pi_sampler, cap), detached; 1 where unknown or masked.

    Yao et al. (2025), "Your efficient RL framework secretly brings you off-policy RL training":
    the sampler's and the trainer's log-probs differ even for identical weights, so the samples
    come from a slightly different policy. Weighting by the ratio corrects that; truncating it at
    ``cap`` bounds the variance a rare large ratio would add.

    Returns:
        ``(weight [B, T], truncated [B, T] bool)``; ``truncated`` marks tokens whose raw weight
        exceeded the cap.
    """
    if sampler_logprobs is None or cap is None:
        return torch.ones_like(old_logprobs), torch.zeros_like(keep)
    known = keep & ~torch.isnan(sampler_logprobs)  # [B, T]
    # Zero the exponent where unknown: exp(NaN) would poison the result even behind a where.
    log_w = torch.where(known, old_logprobs - sampler_logprobs.detach(), 0.0)  # [B, T]
    raw = torch.exp(log_w)  # [B, T], 1 where unknown
    return raw.clamp(max=cap), known & (raw > cap)


def _k3_kl(keep: Tensor, logprobs: Tensor, ref_logprobs: Tensor | None) -> Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): exp(ref - lp) - (ref - lp) - 1, 0 where masked.

    Schulman's "Approximating KL divergence" k3 estimator, as in DeepSeekMath eq. 4: unbiased and
    never negative. Zeros everywhere when there is no reference.
    """
    if ref_logprobs is None:
        return torch.zeros_like(logprobs)
    # Zero the difference before exp so a huge garbage value at a masked position cannot overflow.
    diff = torch.where(keep, ref_logprobs.detach() - logprobs, 0.0)  # [B, T]
    return torch.exp(diff) - diff - 1.0


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float,
                       steps: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic clipped objective, negated to a loss: -min(r*A, clip(r, 1-lo, 1+hi)*A).

    Works on any shape (tokens ``[B, T]`` or sequences ``[B]``). ``steps`` (``[B]``, ``LossInputs.trust_steps``)
    compounds each sequence's range over that many steps: ``clip(r, (1-lo)^n, (1+hi)^n)``.

    Returns:
        ``(loss, clipped)``: ``clipped`` (bool) marks where the clipped term won, which is
        exactly where the gradient is zero.
    """
    unclipped = ratio * advantages
    if steps is None:
        bounded = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    else:
        n = steps.to(ratio.dtype).reshape(steps.shape + (1,) * (ratio.dim() - 1))  # [B] -> [B, 1] for tokens
        bounded = torch.clamp(ratio, min=(1.0 - eps_low) ** n, max=(1.0 + eps_high) ** n)
    clipped = bounded * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


def _masked_loss(t: _Tokens, policy_loss: Tensor, beta: float) -> Tensor:
    """Per-token loss ``[B, T]``: IS-weighted policy loss plus beta * KL, exactly 0 where masked."""
    per_token = policy_loss * t.is_weight
    if beta > 0:
        per_token = per_token + beta * t.kl
    return torch.where(t.keep, per_token, 0.0)


def _stats(t: _Tokens, ratio: Tensor, clipped: Tensor) -> dict[str, Tensor]:
    """Detached stats over masked tokens; ``ratio`` and ``clipped`` are per token ``[B, T]``."""
    with torch.no_grad():
        keep = t.keep
        ratio = ratio.detach()
        return {
            "tokens": t.count.sum(),
            "clipped_tokens": (clipped & keep).sum().to(ratio.dtype),
            "ratio_sum": torch.where(keep, ratio, 0.0).sum(),
            "ratio_max": torch.where(keep, ratio, -math.inf).amax(),
            "ratio_min": torch.where(keep, ratio, math.inf).amin(),
            "kl_sum": t.kl.detach().sum(),
            "is_weight_sum": torch.where(keep, t.is_weight, 0.0).sum(),
            "is_truncated_tokens": t.is_truncated.sum().to(ratio.dtype),
        }


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_range(name: str, value: float, *, low: float, high: float = math.inf, why: str) -> None:
    """Raise ConfigError unless ``low <= value < high`` (``high`` exclusive) and finite."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and low <= value < high):
        bounds = f">= {low}" if high == math.inf else f"in [{low}, {high})"
        raise ConfigError(f"{name} must be a finite number {bounds}, got {value!r}: {why}")


def _check_common(*, beta: float, tis_cap: float | None) -> None:
    _check_range("beta", beta, low=0.0, why="it weights a KL penalty; use 0 to turn it off")
    if tis_cap is not None:
        why = "a cap below 1 would down-weight on-policy tokens; use None to turn TIS off"
        _check_range("tis_cap", tis_cap, low=1.0, why=why)


def _check_epsilon(name: str, value: float, *, lower_side: bool) -> None:
    if lower_side:  # 1 - eps is a ratio bound, so it must stay positive
        _check_range(name, value, low=0.0, high=1.0, why="the lower clip bound 1 - eps must stay positive")
    else:
        _check_range(name, value, low=0.0, why="the clip bound is 1 + eps")


# --------------------------------------------------------------------------------------------
# The losses
# --------------------------------------------------------------------------------------------

# Defaults shared by every class, with their reasons:
#   beta = 0.0     no KL penalty. DAPO and Dr. GRPO train without one and report no loss of
#                  stability, and it saves a forward pass of the base model per micro-batch.
#   tis_cap = 2.0  the cap Yao et al. (2025) use for truncated importance sampling; large enough
#                  to correct typical sampler/trainer mismatch, small enough to bound variance.


@dataclass(frozen=True, kw_only=True)
class GRPOLoss:
    """GRPO: PPO's clipped surrogate per token, averaged per sequence, then over sequences.

    Shao et al. (2024), DeepSeekMath, eq. 3: loss = (1/G) sum_i (1/|o_i|) sum_t
    -min(r_it A_it, clip(r_it, 1-eps, 1+eps) A_it), with G = ``num_sequences`` over the whole step.
    Each sequence weighs the same whatever its length, so a token of a short answer weighs more
    than one of a long answer (the length bias Dr. GRPO removes).

    Args:
        epsilon: Clip range for the token ratio, both sides. Default 0.2, PPO's and DeepSeekMath's.
        beta: KL penalty weight. Default 0.0 (see the note above the classes).
        tis_cap: Truncated-IS cap, or None to turn TIS off. Default 2.0 (Yao et al. 2025).

    Raises:
        ConfigError: On construction, for an argument out of range; on call, for bad inputs.
    """

    epsilon: float = 0.2
    beta: float = 0.0
    tis_cap: float | None = 2.0

    default_advantage_scale: ClassVar[AdvantageScale] = "group"

    def __post_init__(self) -> None:
        _check_epsilon("epsilon", self.epsilon, lower_side=True)
        _check_common(beta=self.beta, tis_cap=self.tis_cap)

    def __call__(self, inputs: LossInputs) -> LossOutput:
        t = _prepare(inputs, beta=self.beta, tis_cap=self.tis_cap)
        ratio = torch.exp(t.log_ratio)  # [B, T]
        surrogate, clipped = _clipped_surrogate(ratio, t.advantages, self.epsilon, self.epsilon, inputs.trust_steps)
        per_token = _masked_loss(t, surrogate, self.beta)  # [B, T]
        per_sequence = per_token.sum(dim=-1) / t.count.clamp(min=1.0)  # [B]
        loss = per_sequence.sum() / inputs.num_sequences
        return LossOutput(loss=loss, stats=_stats(t, ratio, clipped))


@dataclass(frozen=True, kw_only=True)
class DrGRPOLoss:
    """Dr. GRPO: GRPO's token surrogate, summed and divided by a constant token budget.

    Liu et al. (2025), "Understanding R1-Zero-Like Training: A Critical Perspective": dividing
    each sequence by its own length favours long wrong answers (a long wrong answer's tokens are
    each penalised less) and dividing advantages by the group's std favours too-easy and too-hard
    questions. Dr. GRPO drops both: loss = sum of masked token losses / (num_sequences * max_tokens).

    Args:
        epsilon: Clip range for the token ratio, both sides. Default 0.2, as in GRPO.
        beta: KL penalty weight. Default 0.0 (the paper trains without it).
        tis_cap: Truncated-IS cap, or None to turn TIS off. Default 2.0 (Yao et al. 2025).
        max_tokens: The constant per-sequence normaliser: the paper uses the generation budget.
            Default 1024, a common completion budget; set it to your own budget. Any constant is
            correct (it only rescales the learning rate), but it must not change between runs you
            want to compare.

    Raises:
        ConfigError: On construction, for an argument out of range; on call, for bad inputs.
    """

    epsilon: float = 0.2
    beta: float = 0.0
    tis_cap: float | None = 2.0
    max_tokens: int = 1024

    default_advantage_scale: ClassVar[AdvantageScale] = "none"

    def __post_init__(self) -> None:
        _check_epsilon("epsilon", self.epsilon, lower_side=True)
        _check_common(beta=self.beta, tis_cap=self.tis_cap)
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be a positive int (the generation budget), got {self.max_tokens!r}")

    def __call__(self, inputs: LossInputs) -> LossOutput:
        t = _prepare(inputs, beta=self.beta, tis_cap=self.tis_cap)
        ratio = torch.exp(t.log_ratio)  # [B, T]
        surrogate, clipped = _clipped_surrogate(ratio, t.advantages, self.epsilon, self.epsilon, inputs.trust_steps)
        per_token = _masked_loss(t, surrogate, self.beta)  # [B, T]
        loss = per_token.sum() / (inputs.num_sequences * self.max_tokens)
        return LossOutput(loss=loss, stats=_stats(t, ratio, clipped))


@dataclass(frozen=True, kw_only=True)
class DAPOLoss:
    """DAPO: clip-higher surrogate per token, averaged over every token of the step.

    Yu et al. (2025), "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", eq. 8:
    the upper clip bound is raised (clip(r, 1-eps_low, 1+eps_high)) so unlikely tokens with a
    positive advantage can still grow, which keeps entropy from collapsing; and the loss is a
    token-level mean (sum / ``num_tokens``), so every token weighs the same.

    Args:
        epsilon_low: Lower clip range. Default 0.2, the paper's (unchanged from PPO).
        epsilon_high: Upper clip range. Default 0.28, the paper's.
        beta: KL penalty weight. Default 0.0 (the paper removes the KL term).
        tis_cap: Truncated-IS cap, or None to turn TIS off. Default 2.0 (Yao et al. 2025).

    Raises:
        ConfigError: On construction, for an argument out of range; on call, for bad inputs.
    """

    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    beta: float = 0.0
    tis_cap: float | None = 2.0

    default_advantage_scale: ClassVar[AdvantageScale] = "group"

    def __post_init__(self) -> None:
        _check_epsilon("epsilon_low", self.epsilon_low, lower_side=True)
        _check_epsilon("epsilon_high", self.epsilon_high, lower_side=False)
        _check_common(beta=self.beta, tis_cap=self.tis_cap)

    def __call__(self, inputs: LossInputs) -> LossOutput:
        t = _prepare(inputs, beta=self.beta, tis_cap=self.tis_cap)
        ratio = torch.exp(t.log_ratio)  # [B, T]
        surrogate, clipped = _clipped_surrogate(ratio, t.advantages, self.epsilon_low, self.epsilon_high,
                                                inputs.trust_steps)
        per_token = _masked_loss(t, surrogate, self.beta)  # [B, T]
        loss = per_token.sum() / inputs.num_tokens
        return LossOutput(loss=loss, stats=_stats(t, ratio, clipped))


@dataclass(frozen=True, kw_only=True)
class GSPOLoss:
    """GSPO: one length-normalised ratio per sequence, clipped per sequence.

    Zheng et al. (2025), "Group Sequence Policy Optimization", eq. 5-7: s_i = exp(mean_t(lp - old))
    over the sequence's masked tokens, A_i = the mean of its token advantages, and
    loss = (1/G) sum_i -min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i). Token ratios are
    noisy importance weights for a sequence-level reward; the sequence ratio is not.
    Truncated IS and the KL penalty are applied per sequence, as the mean over its masked tokens.
    In the stats, a clipped sequence counts all its tokens as clipped, and each token carries its
    sequence's ratio.

    Args:
        epsilon_low: Lower clip range. Default 3e-4, the paper's: a mean log-ratio moves far less
            than a single token's, so the range is tiny.
        epsilon_high: Upper clip range. Default 4e-4, the paper's.
        beta: KL penalty weight. Default 0.0 (the paper reports no KL term).
        tis_cap: Truncated-IS cap, or None to turn TIS off. Default 2.0 (Yao et al. 2025).

    Raises:
        ConfigError: On construction, for an argument out of range; on call, for bad inputs.
    """

    epsilon_low: float = 3e-4
    epsilon_high: float = 4e-4
    beta: float = 0.0
    tis_cap: float | None = 2.0

    default_advantage_scale: ClassVar[AdvantageScale] = "group"

    def __post_init__(self) -> None:
        _check_epsilon("epsilon_low", self.epsilon_low, lower_side=True)
        _check_epsilon("epsilon_high", self.epsilon_high, lower_side=False)
        _check_common(beta=self.beta, tis_cap=self.tis_cap)

    def __call__(self, inputs: LossInputs) -> LossOutput:
        t = _prepare(inputs, beta=self.beta, tis_cap=self.tis_cap)
        # A sequence with no masked token gets s = 1, A = 0, weight 0: it contributes nothing.
        count = t.count.clamp(min=1.0)  # [B]
        seq_ratio = torch.exp(t.log_ratio.sum(dim=-1) / count)  # [B]
        seq_advantage = t.advantages.sum(dim=-1) / count  # [B]
        surrogate, seq_clipped = _clipped_surrogate(seq_ratio, seq_advantage, self.epsilon_low, self.epsilon_high,
                                                        inputs.trust_steps)
        seq_weight = torch.where(t.keep, t.is_weight, 0.0).sum(dim=-1) / count  # [B]
        per_sequence = surrogate * seq_weight  # [B]
        if self.beta > 0:
            per_sequence = per_sequence + self.beta * t.kl.sum(dim=-1) / count
        loss = per_sequence.sum() / inputs.num_sequences
        token_ratio = seq_ratio[:, None].expand_as(t.log_ratio)  # [B] -> [B, T]
        token_clipped = seq_clipped[:, None].expand_as(t.keep)  # [B] -> [B, T]
        return LossOutput(loss=loss, stats=_stats(t, token_ratio, token_clipped))


@dataclass(frozen=True, kw_only=True)
class CISPOLoss:
    """CISPO: REINFORCE with a clipped, detached importance weight, so no token loses its gradient.

    MiniMax-M1 (MiniMax, 2025), eq. 4-5: loss per token = -sg(min(r, 1+eps_high)) * A * log pi,
    summed over masked tokens and divided by ``num_tokens``. PPO-style clipping zeroes the
    gradient of tokens whose ratio left the trust region, which tends to be the rare "fork"
    tokens (e.g. "However", "Wait") that matter most; CISPO bounds the weight instead. As in the
    paper there is no lower bound on the weight. ``clipped_tokens`` counts tokens whose weight was
    capped (they still get a gradient). ``LossInputs.trust_steps`` leaves the cap as it is: it bounds
    the variance of a weight, not how far a step goes.

    Args:
        epsilon_high: The weight is capped at 1 + epsilon_high. Default 3.0, a cap of 4.0 on the
            weight (the default of Thinking Machines' Tinker CISPO loss). MiniMax-M1 tunes only
            this upper bound, per task. Unlike PPO's 0.2, the cap is not a trust region (it never
            removes a gradient), only a bound on the variance of rare large weights, so it can be
            generous: it binds only on strongly off-policy tokens and never on-policy (r = 1).
        beta: KL penalty weight. Default 0.0 (MiniMax-M1 uses no KL term).
        tis_cap: Truncated-IS cap, or None to turn TIS off. Default 2.0 (Yao et al. 2025).

    Raises:
        ConfigError: On construction, for an argument out of range; on call, for bad inputs.
    """

    epsilon_high: float = 3.0
    beta: float = 0.0
    tis_cap: float | None = 2.0

    default_advantage_scale: ClassVar[AdvantageScale] = "group"

    def __post_init__(self) -> None:
        _check_epsilon("epsilon_high", self.epsilon_high, lower_side=False)
        _check_common(beta=self.beta, tis_cap=self.tis_cap)

    def __call__(self, inputs: LossInputs) -> LossOutput:
        t = _prepare(inputs, beta=self.beta, tis_cap=self.tis_cap)
        ratio = torch.exp(t.log_ratio)  # [B, T]
        cap = 1.0 + self.epsilon_high
        weight = ratio.detach().clamp(max=cap)  # [B, T], the stop-gradient
        per_token = _masked_loss(t, -weight * t.advantages * t.logprobs, self.beta)  # [B, T]
        loss = per_token.sum() / inputs.num_tokens
        return LossOutput(loss=loss, stats=_stats(t, ratio, ratio.detach() > cap))


# --------------------------------------------------------------------------------------------
# Name -> class table
# --------------------------------------------------------------------------------------------

LOSSES: dict[str, type[Loss]] = {
    "grpo": GRPOLoss,
    "dr_grpo": DrGRPOLoss,
    "dapo": DAPOLoss,
    "gspo": GSPOLoss,
    "cispo": CISPOLoss,
}
"""Every loss by the name configs use. Adding a loss is one class and one line here."""


def build_loss(name: str, **kwargs: object) -> Loss:
    """Build the loss registered under ``name`` with its keyword arguments.

    Args:
        name: A key of ``LOSSES``: "grpo", "dr_grpo", "dapo", "gspo" or "cispo".
        **kwargs: Constructor arguments of that loss; omitted ones take its documented defaults.

    Returns:
        The loss instance.

    Raises:
        ConfigError: ``name`` is unknown (the message lists the valid names), a keyword is not an
            argument of that loss (the message names it and lists the accepted ones), or a value
            is out of range.
    """
    cls = LOSSES.get(name)
    if cls is None:
        raise ConfigError(f"unknown loss {name!r}: use one of {', '.join(map(repr, LOSSES))}")
    accepted = [field.name for field in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ConfigError(
            f"loss {name!r} has no argument(s) {', '.join(map(repr, unknown))}: it accepts {', '.join(accepted)}"
        )
    return cls(**kwargs)
