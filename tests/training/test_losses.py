"""Policy losses, checked against losses and gradients worked out by hand.

Conventions in the comments: r is the token ratio exp(logprobs - old_logprobs), A the advantage,
"grad" the gradient of the returned loss w.r.t. ``logprobs``. Since dr/dlp = r, a token whose
loss is -r*A has grad -r*A, divided by whatever normaliser the variant uses.
"""

from __future__ import annotations

import math

import pytest
import torch

from art_core.errors import ConfigError
from art_core.training.losses import (
    LOSSES,
    CISPOLoss,
    DAPOLoss,
    DrGRPOLoss,
    GRPOLoss,
    GSPOLoss,
    Loss,
    LossInputs,
    LossOutput,
    build_loss,
)


LN2 = math.log(2.0)
LN1_5 = math.log(1.5)
LN0_5 = math.log(0.5)


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def make_inputs(
    logprobs: list[list[float]],
    *,
    log_ratio: list[list[float]] | None = None,
    advantages: list[list[float]],
    mask: list[list[float]] | None = None,
    num_sequences: int | None = None,
    num_tokens: int | None = None,
    sampler_logprobs: list[list[float]] | None = None,
    ref_logprobs: list[list[float]] | None = None,
) -> LossInputs:
    """Inputs with ``old_logprobs = logprobs - log_ratio`` (on-policy ``logprobs.detach()`` if None)."""
    lp = t(logprobs).requires_grad_(True)
    old = lp.detach().clone() if log_ratio is None else lp.detach() - t(log_ratio)
    m = torch.ones_like(lp) if mask is None else t(mask)
    return LossInputs(
        logprobs=lp,
        old_logprobs=old,
        advantages=t(advantages),
        mask=m,
        num_sequences=lp.shape[0] if num_sequences is None else num_sequences,
        num_tokens=int(m.sum().item()) if num_tokens is None else num_tokens,
        sampler_logprobs=None if sampler_logprobs is None else t(sampler_logprobs),
        ref_logprobs=None if ref_logprobs is None else t(ref_logprobs),
    )


def run(loss_fn: Loss, inputs: LossInputs) -> tuple[LossOutput, torch.Tensor]:
    out = loss_fn(inputs)
    out.loss.backward()
    assert inputs.logprobs.grad is not None
    return out, inputs.logprobs.grad


def close(actual: torch.Tensor, expected: float | list[list[float]]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32))


# Two inputs reused by several variants.
#
# ON_POLICY: 2x3, old = logprobs.detach(), so r = 1 everywhere.
#   seq 0: A = +1, mask [1, 1, 0] (2 tokens)      seq 1: A = -0.5, mask [1, 1, 1] (3 tokens)
#   token losses -r*A: seq 0 [-1, -1, (masked)], seq 1 [0.5, 0.5, 0.5]


def on_policy() -> LossInputs:
    return make_inputs(
        [[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.7]],
        advantages=[[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]],
        mask=[[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]],
    )


# --------------------------------------------------------------------------------------------
# GRPO
# --------------------------------------------------------------------------------------------


def test_grpo_on_policy_is_mean_per_sequence_then_over_sequences() -> None:
    # seq 0 mean over its 2 tokens: -1; seq 1 mean over 3: 0.5
    # loss = (-1 + 0.5) / num_sequences 2 = -0.25
    # grad: seq 0 tokens -A / (2 tokens * 2 seqs) = -0.25; seq 1 tokens 0.5 / (3 * 2) = 1/12
    out, grad = run(GRPOLoss(), on_policy())
    close(out.loss, -0.25)
    close(grad, [[-0.25, -0.25, 0.0], [1 / 12, 1 / 12, 1 / 12]])
    close(out.stats["tokens"], 5.0)
    close(out.stats["ratio_sum"], 5.0)
    close(out.stats["clipped_tokens"], 0.0)


def test_grpo_off_policy_clips_both_sides() -> None:
    # epsilon 0.2, clip range [0.8, 1.2]
    # seq 0, A = +1, r = [1.5, 0.5, 1.1]
    #   1.5: min(1.5, 1.2) = 1.2 -> loss -1.2, clipped, grad 0
    #   0.5: min(0.5, 0.8) = 0.5 -> loss -0.5,          grad -0.5
    #   1.1: inside              -> loss -1.1,          grad -1.1
    # seq 1, A = -1, r = [1.5, 0.5, 1.0]
    #   1.5: min(-1.5, -1.2) = -1.5 -> loss 1.5,           grad 1.5
    #   0.5: min(-0.5, -0.8) = -0.8 -> loss 0.8, clipped,  grad 0
    #   1.0: inside                 -> loss 1.0,           grad 1.0
    # per-sequence means: -2.8/3 and 3.3/3; loss = (0.5/3) / 2 = 1/12 = 0.083333
    # grads divided by 3 tokens * 2 sequences = 6
    inputs = make_inputs(
        [[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.7]],
        log_ratio=[[LN1_5, LN0_5, math.log(1.1)], [LN1_5, LN0_5, 0.0]],
        advantages=[[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]],
    )
    out, grad = run(GRPOLoss(epsilon=0.2), inputs)
    close(out.loss, 1 / 12)
    close(grad, [[0.0, -0.5 / 6, -1.1 / 6], [1.5 / 6, 0.0, 1.0 / 6]])
    close(out.stats["clipped_tokens"], 2.0)
    close(out.stats["ratio_sum"], 1.5 + 0.5 + 1.1 + 1.5 + 0.5 + 1.0)
    close(out.stats["ratio_max"], 1.5)
    close(out.stats["ratio_min"], 0.5)


# --------------------------------------------------------------------------------------------
# Dr. GRPO
# --------------------------------------------------------------------------------------------


def test_dr_grpo_on_policy_divides_by_constant_budget() -> None:
    # sum of masked token losses: -1 - 1 + 0.5 * 3 = -0.5
    # loss = -0.5 / (num_sequences 2 * max_tokens 4) = -0.0625
    # grad = -A / 8: seq 0 -0.125, seq 1 +0.0625 (no per-sequence length in the normaliser)
    out, grad = run(DrGRPOLoss(max_tokens=4), on_policy())
    close(out.loss, -0.0625)
    close(grad, [[-0.125, -0.125, 0.0], [0.0625, 0.0625, 0.0625]])


def test_dr_grpo_off_policy_clips_both_sides() -> None:
    # same token losses as the GRPO off-policy test: seq 0 [-1.2 (clipped), -0.5, -1.1],
    # seq 1 [1.5, 0.8 (clipped), 1.0]; sum 0.5
    # loss = 0.5 / (2 sequences * max_tokens 5) = 0.05; grads are the token grads / 10
    inputs = make_inputs(
        [[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.7]],
        log_ratio=[[LN1_5, LN0_5, math.log(1.1)], [LN1_5, LN0_5, 0.0]],
        advantages=[[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]],
    )
    out, grad = run(DrGRPOLoss(max_tokens=5), inputs)
    close(out.loss, 0.05)
    close(grad, [[0.0, -0.05, -0.11], [0.15, 0.0, 0.1]])
    close(out.stats["clipped_tokens"], 2.0)


# --------------------------------------------------------------------------------------------
# DAPO
# --------------------------------------------------------------------------------------------


def test_dapo_on_policy_is_a_token_mean_over_the_step() -> None:
    # sum of masked token losses -0.5 over num_tokens 5: loss -0.1
    # grad = -A / 5: seq 0 -0.2, seq 1 +0.1
    out, grad = run(DAPOLoss(), on_policy())
    close(out.loss, -0.1)
    close(grad, [[-0.2, -0.2, 0.0], [0.1, 0.1, 0.1]])


def test_dapo_off_policy_clip_higher() -> None:
    # clip range [1 - 0.2, 1 + 0.28] = [0.8, 1.28]
    # seq 0, A = +1, r = [1.5, 0.5, 1.25]
    #   1.5:  min(1.5, 1.28) -> loss -1.28, clipped, grad 0
    #   0.5:  min(0.5, 0.8)  -> loss -0.5,           grad -0.5
    #   1.25: inside (GRPO's 1.2 would have clipped it) -> loss -1.25, grad -1.25
    # seq 1, A = -1, r = [1.5, 0.7, 1.0]
    #   1.5:  min(-1.5, -1.28) = -1.5 -> loss 1.5,           grad 1.5
    #   0.7:  min(-0.7, -0.8)  = -0.8 -> loss 0.8, clipped,  grad 0
    #   1.0:                             loss 1.0,           grad 1.0
    # sum -1.28 - 0.5 - 1.25 + 1.5 + 0.8 + 1.0 = 0.27; / num_tokens 6 = 0.045; grads / 6
    inputs = make_inputs(
        [[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.7]],
        log_ratio=[[LN1_5, LN0_5, math.log(1.25)], [LN1_5, math.log(0.7), 0.0]],
        advantages=[[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]],
    )
    out, grad = run(DAPOLoss(), inputs)
    close(out.loss, 0.045)
    close(grad, [[0.0, -0.5 / 6, -1.25 / 6], [1.5 / 6, 0.0, 1.0 / 6]])
    close(out.stats["clipped_tokens"], 2.0)


def test_dapo_stale_sequences_clip_over_their_compounded_range() -> None:
    # The inputs above, with trust_steps [2, 1]: seq 0 sampled one step before the one training.
    # seq 0, A = +1, range [0.8^2, 1.28^2] = [0.64, 1.6384], r = [1.5, 0.5, 1.25]
    #   1.5:  inside now           -> loss -1.5,  grad -1.5
    #   0.5:  min(0.5, 0.64)       -> loss -0.5,  grad -0.5
    #   1.25: inside               -> loss -1.25, grad -1.25
    # seq 1, A = -1, one step's range [0.8, 1.28], as before: 1.5, 0.8 (clipped, grad 0), 1.0
    # sum -1.5 - 0.5 - 1.25 + 1.5 + 0.8 + 1.0 = 0.05; / num_tokens 6; grads / 6
    inputs = make_inputs(
        [[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.7]],
        log_ratio=[[LN1_5, LN0_5, math.log(1.25)], [LN1_5, math.log(0.7), 0.0]],
        advantages=[[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]],
    )
    inputs.trust_steps = torch.tensor([2.0, 1.0])
    out, grad = run(DAPOLoss(), inputs)
    close(out.loss, 0.05 / 6)
    close(grad, [[-1.5 / 6, -0.5 / 6, -1.25 / 6], [1.5 / 6, 0.0, 1.0 / 6]])
    close(out.stats["clipped_tokens"], 1.0)


@pytest.mark.parametrize("name", list(LOSSES))
def test_one_trust_step_per_sequence_is_the_plain_loss(name: str) -> None:
    loss_fn = build_loss(name, beta=0.1)
    plain, plain_grad = run(loss_fn, off_policy_batch())
    inputs = off_policy_batch()
    inputs.trust_steps = torch.ones(2)
    ones, ones_grad = run(loss_fn, inputs)
    torch.testing.assert_close(ones.loss, plain.loss)
    torch.testing.assert_close(ones_grad, plain_grad)


def test_trust_steps_of_the_wrong_shape_are_refused() -> None:
    inputs = on_policy()
    inputs.trust_steps = torch.ones(3)
    with pytest.raises(ConfigError, match=r"trust_steps must be a \[B\] = \(2,\) tensor.*got shape \(3,\)"):
        DAPOLoss()(inputs)


# --------------------------------------------------------------------------------------------
# GSPO
# --------------------------------------------------------------------------------------------


def test_gspo_on_policy_uses_sequence_ratio_and_mean_advantage() -> None:
    # s_i = 1 for both; A_0 = mean(1, 1) = 1 over its 2 masked tokens, A_1 = -0.5
    # loss = (-1 + 0.5) / 2 = -0.25
    # ds_i/dlp_t = s_i / n_i, so grad = -A_i / n_i / 2: seq 0 -0.25, seq 1 0.5/3/2 = 1/12
    out, grad = run(GSPOLoss(), on_policy())
    close(out.loss, -0.25)
    close(grad, [[-0.25, -0.25, 0.0], [1 / 12, 1 / 12, 1 / 12]])


def test_gspo_off_policy_clips_whole_sequences_on_both_sides() -> None:
    # defaults: clip range [1 - 3e-4, 1 + 4e-4] = [0.9997, 1.0004]
    # seq 0: token log-ratios [2 ln1.5, ln1.5, 0], mean ln1.5 -> s = 1.5; A = +1
    #   min(1.5, 1.0004) = 1.0004 -> loss -1.0004, clipped, grad 0
    # seq 1: token log-ratios [0, ln0.5, 2 ln0.5], mean ln0.5 -> s = 0.5; A = -1
    #   min(-0.5, -0.9997) = -0.9997 -> loss 0.9997, clipped, grad 0
    # loss = (-1.0004 + 0.9997) / 2 = -0.00035; every token counts as clipped (6)
    inputs = make_inputs(
        [[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.7]],
        log_ratio=[[2 * LN1_5, LN1_5, 0.0], [0.0, LN0_5, 2 * LN0_5]],
        advantages=[[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]],
    )
    out, grad = run(GSPOLoss(), inputs)
    close(out.loss, -0.00035)
    close(grad, [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    close(out.stats["clipped_tokens"], 6.0)
    close(out.stats["ratio_sum"], 3 * 1.5 + 3 * 0.5)  # each token carries its sequence's ratio
    close(out.stats["ratio_max"], 1.5)
    close(out.stats["ratio_min"], 0.5)


def test_gspo_off_policy_unclipped_side_keeps_its_gradient() -> None:
    # seq 0: s = 0.5, A = +1: min(0.5, 0.9997) = 0.5  -> loss -0.5
    #   grad per token: -A * s / n / 2 = -0.5 / 3 / 2 = -1/12
    # seq 1: s = 1.5, A = -1: min(-1.5, -1.0004) = -1.5 -> loss 1.5
    #   grad per token: -A * s / n / 2 = 1.5 / 3 / 2 = 0.25
    # loss = (-0.5 + 1.5) / 2 = 0.5
    inputs = make_inputs(
        [[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.7]],
        log_ratio=[[0.0, LN0_5, 2 * LN0_5], [2 * LN1_5, LN1_5, 0.0]],
        advantages=[[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]],
    )
    out, grad = run(GSPOLoss(), inputs)
    close(out.loss, 0.5)
    close(grad, [[-1 / 12, -1 / 12, -1 / 12], [0.25, 0.25, 0.25]])
    close(out.stats["clipped_tokens"], 0.0)


# --------------------------------------------------------------------------------------------
# CISPO
# --------------------------------------------------------------------------------------------


def test_cispo_on_policy_is_reinforce() -> None:
    # 1x3, r = 1 so the weight is 1; A = +1, logprobs [-1, -2, -0.5]
    # loss = -sum(1 * 1 * lp) / 3 = 3.5 / 3 = 1.166667; grad = -w * A / 3 = -1/3
    inputs = make_inputs([[-1.0, -2.0, -0.5]], advantages=[[1.0, 1.0, 1.0]])
    out, grad = run(CISPOLoss(), inputs)
    close(out.loss, 3.5 / 3)
    close(grad, [[-1 / 3, -1 / 3, -1 / 3]])


def test_cispo_off_policy_caps_the_weight_but_keeps_every_gradient() -> None:
    # cap = 1 + epsilon_high 3.0 = 4; weights w = sg(min(r, 4)); loss per token -w * A * lp
    # seq 0, A = +1, r = [5, 0.5, 1], lp [-1, -2, -0.5]: w = [4, 0.5, 1]
    #   losses [4, 1, 0.5], grads -w*A = [-4, -0.5, -1]
    # seq 1, A = -1, r = [5, 0.5, 1], lp [-0.25, -1, -2]: w = [4, 0.5, 1]
    #   losses w * lp = [-1, -0.5, -2], grads w = [4, 0.5, 1]
    # sum 5.5 - 3.5 = 2; / num_tokens 6 = 0.333333; grads / 6 (none is zero, unlike PPO clipping)
    inputs = make_inputs(
        [[-1.0, -2.0, -0.5], [-0.25, -1.0, -2.0]],
        log_ratio=[[math.log(5.0), LN0_5, 0.0], [math.log(5.0), LN0_5, 0.0]],
        advantages=[[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]],
    )
    out, grad = run(CISPOLoss(), inputs)
    close(out.loss, 2 / 6)
    close(grad, [[-4 / 6, -0.5 / 6, -1 / 6], [4 / 6, 0.5 / 6, 1 / 6]])
    close(out.stats["clipped_tokens"], 2.0)
    close(out.stats["ratio_max"], 5.0)


# --------------------------------------------------------------------------------------------
# Truncated importance sampling
# --------------------------------------------------------------------------------------------


def test_tis_weights_are_capped_and_nan_sampler_logprobs_ignored() -> None:
    # on-policy GRPO, 1x3, A = +1, old = lp = [-1, -1, -1]
    # sampler = old - [ln3, ln0.5, NaN]: raw w = exp(old - sampler) = [3, 0.5, unknown]
    # w = [min(3, 2), 0.5, 1] = [2, 0.5, 1]; token losses -r*A*w = [-2, -0.5, -1]
    # loss = mean -3.5 / 3 = -1.166667; grad = -A * w / 3 = [-2/3, -1/6, -1/3]
    inputs = make_inputs(
        [[-1.0, -1.0, -1.0]],
        advantages=[[1.0, 1.0, 1.0]],
        sampler_logprobs=[[-1.0 - math.log(3.0), -1.0 - LN0_5, math.nan]],
    )
    out, grad = run(GRPOLoss(tis_cap=2.0), inputs)
    close(out.loss, -3.5 / 3)
    close(grad, [[-2 / 3, -1 / 6, -1 / 3]])
    close(out.stats["is_weight_sum"], 3.5)
    close(out.stats["is_truncated_tokens"], 1.0)


def test_all_nan_sampler_logprobs_or_no_cap_change_nothing() -> None:
    baseline, baseline_grad = run(DAPOLoss(), on_policy())
    all_nan = on_policy()
    all_nan.sampler_logprobs = torch.full((2, 3), math.nan)
    out, grad = run(DAPOLoss(), all_nan)
    close(out.loss, baseline.loss.item())
    torch.testing.assert_close(grad, baseline_grad)
    close(out.stats["is_weight_sum"], 5.0)  # weight 1 on each of the 5 tokens

    no_cap = on_policy()
    no_cap.sampler_logprobs = torch.full((2, 3), -10.0)  # raw weights would be huge
    out, grad = run(DAPOLoss(tis_cap=None), no_cap)
    close(out.loss, baseline.loss.item())
    torch.testing.assert_close(grad, baseline_grad)
    close(out.stats["is_truncated_tokens"], 0.0)


def test_gspo_weights_each_sequence_by_its_mean_tis_weight() -> None:
    # on-policy, 1x3, A = +1, s = 1; token weights [min(3, 2), 0.5, 1] = [2, 0.5, 1], mean 3.5/3
    # loss = -1 * 3.5/3 / 1 sequence = -1.166667
    # grad = -A * w_mean * s / n = -(3.5/3) / 3 = -0.388889 on each token
    inputs = make_inputs(
        [[-1.0, -1.0, -1.0]],
        advantages=[[1.0, 1.0, 1.0]],
        sampler_logprobs=[[-1.0 - math.log(3.0), -1.0 - LN0_5, math.nan]],
    )
    out, grad = run(GSPOLoss(), inputs)
    close(out.loss, -3.5 / 3)
    close(grad, [[-3.5 / 9, -3.5 / 9, -3.5 / 9]])


# --------------------------------------------------------------------------------------------
# KL penalty
# --------------------------------------------------------------------------------------------


def test_kl_penalty_matches_k3_by_hand() -> None:
    # A = 0 so only the KL term is left. lp = [-1, -1, -1], ref = lp + [ln2, 0, -ln2]
    # d = ref - lp = [ln2, 0, -ln2]; k3 = e^d - d - 1 = [1 - ln2, 0, ln2 - 0.5] = [0.306853, 0, 0.193147]
    # kl_sum = 0.5; GRPO: mean over 3 tokens 1/6, times beta 0.1 -> loss 0.016667
    # dk3/dlp = 1 - e^d = [-1, 0, 0.5]; grad = beta * that / 3 = [-1/30, 0, 1/60]
    inputs = make_inputs(
        [[-1.0, -1.0, -1.0]],
        advantages=[[0.0, 0.0, 0.0]],
        ref_logprobs=[[-1.0 + LN2, -1.0, -1.0 - LN2]],
    )
    out, grad = run(GRPOLoss(beta=0.1), inputs)
    close(out.loss, 0.1 / 6)
    close(grad, [[-1 / 30, 0.0, 1 / 60]])
    close(out.stats["kl_sum"], 0.5)


def test_kl_is_reported_but_not_trained_on_when_beta_is_zero() -> None:
    inputs = make_inputs(
        [[-1.0, -1.0, -1.0]],
        advantages=[[0.0, 0.0, 0.0]],
        ref_logprobs=[[-1.0 + LN2, -1.0, -1.0 - LN2]],
    )
    out, grad = run(GRPOLoss(), inputs)
    close(out.loss, 0.0)
    close(grad, [[0.0, 0.0, 0.0]])
    close(out.stats["kl_sum"], 0.5)


@pytest.mark.parametrize("name", list(LOSSES))
def test_beta_without_ref_logprobs_raises(name: str) -> None:
    with pytest.raises(ConfigError, match=r"beta=0.04 .* pass ref_logprobs .* or set beta=0"):
        build_loss(name, beta=0.04)(on_policy())


# --------------------------------------------------------------------------------------------
# Properties every loss must have
# --------------------------------------------------------------------------------------------


def off_policy_batch(
    *, lp: torch.Tensor | None = None, garbage: float | None = None, rows: slice = slice(None)
) -> LossInputs:
    """A 2x3 off-policy batch with sampler and ref log-probs; position [0, 2] is masked.

    ``garbage`` overwrites every input at the masked position; ``rows`` takes a micro-batch while
    keeping the whole step's normalisers (2 sequences, 5 tokens).
    """
    logprobs = t([[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.7]])
    fields = {
        "old_logprobs": logprobs - t([[0.4, -0.3, 0.0], [0.1, -0.6, 0.2]]),
        "advantages": t([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]]),
        "sampler_logprobs": logprobs - t([[0.9, 0.0, 0.0], [math.nan, -0.2, 0.1]]),
        "ref_logprobs": logprobs + t([[0.3, -0.2, 0.0], [0.1, 0.5, -0.4]]),
    }
    mask = t([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    if garbage is not None:
        logprobs[0, 2] = garbage
        for name in fields:
            fields[name][0, 2] = -garbage if name != "sampler_logprobs" else math.nan
    lp = logprobs[rows].clone().requires_grad_(True) if lp is None else lp
    return LossInputs(
        logprobs=lp,
        mask=mask[rows],
        num_sequences=2,
        num_tokens=5,
        **{name: value[rows] for name, value in fields.items()},
    )


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("garbage", [1e4, -1e4, math.nan])
def test_masked_positions_have_no_effect(name: str, garbage: float) -> None:
    loss_fn = build_loss(name, beta=0.1)
    clean, clean_grad = run(loss_fn, off_policy_batch())
    dirty, dirty_grad = run(loss_fn, off_policy_batch(garbage=garbage))
    torch.testing.assert_close(dirty.loss, clean.loss)
    torch.testing.assert_close(dirty_grad, clean_grad)
    assert dirty_grad[0, 2] == 0.0
    for key, value in clean.stats.items():
        torch.testing.assert_close(dirty.stats[key], value, msg=key)


@pytest.mark.parametrize("name", list(LOSSES))
def test_micro_batches_sum_to_the_full_batch(name: str) -> None:
    loss_fn = build_loss(name, beta=0.1)
    full, full_grad = run(loss_fn, off_policy_batch())
    first, first_grad = run(loss_fn, off_policy_batch(rows=slice(0, 1)))
    second, second_grad = run(loss_fn, off_policy_batch(rows=slice(1, 2)))
    torch.testing.assert_close(first.loss + second.loss, full.loss)
    torch.testing.assert_close(torch.cat([first_grad, second_grad]), full_grad)
    for key in ("tokens", "clipped_tokens", "ratio_sum", "kl_sum", "is_weight_sum", "is_truncated_tokens"):
        torch.testing.assert_close(first.stats[key] + second.stats[key], full.stats[key], msg=key)
    ratio_max = torch.maximum(first.stats["ratio_max"], second.stats["ratio_max"])
    ratio_min = torch.minimum(first.stats["ratio_min"], second.stats["ratio_min"])
    torch.testing.assert_close(ratio_max, full.stats["ratio_max"])
    torch.testing.assert_close(ratio_min, full.stats["ratio_min"])


@pytest.mark.parametrize("name", list(LOSSES))
def test_stats_are_detached_and_loss_is_scalar(name: str) -> None:
    out = build_loss(name)(off_policy_batch())
    assert out.loss.dim() == 0 and out.loss.requires_grad
    assert not any(value.requires_grad for value in out.stats.values())


def test_shape_mismatch_names_the_shapes() -> None:
    inputs = on_policy()
    inputs.advantages = torch.zeros(2, 4)
    with pytest.raises(ConfigError, match=r"logprobs \(2, 3\).*advantages \(2, 4\)"):
        GRPOLoss()(inputs)


def test_bad_normalisers_raise() -> None:
    inputs = on_policy()
    inputs.num_sequences = 1  # smaller than this micro-batch's 2 sequences
    with pytest.raises(ConfigError, match=r"num_sequences"):
        GRPOLoss()(inputs)
    inputs = on_policy()
    inputs.num_tokens = 0
    with pytest.raises(ConfigError, match=r"num_tokens"):
        DAPOLoss()(inputs)


# --------------------------------------------------------------------------------------------
# The table and build_loss
# --------------------------------------------------------------------------------------------


def test_table_defaults_and_advantage_scales() -> None:
    assert {name: cls.default_advantage_scale for name, cls in LOSSES.items()} == {
        "grpo": "group",
        "dr_grpo": "none",
        "dapo": "group",
        "gspo": "group",
        "cispo": "group",
    }
    assert GRPOLoss() == GRPOLoss(epsilon=0.2, beta=0.0, tis_cap=2.0)
    assert DrGRPOLoss() == DrGRPOLoss(epsilon=0.2, beta=0.0, tis_cap=2.0, max_tokens=1024)
    assert DAPOLoss() == DAPOLoss(epsilon_low=0.2, epsilon_high=0.28, beta=0.0, tis_cap=2.0)
    assert GSPOLoss() == GSPOLoss(epsilon_low=3e-4, epsilon_high=4e-4, beta=0.0, tis_cap=2.0)
    assert CISPOLoss() == CISPOLoss(epsilon_high=3.0, beta=0.0, tis_cap=2.0)
    for cls in LOSSES.values():
        assert isinstance(cls(), Loss)


def test_build_loss_passes_arguments() -> None:
    loss_fn = build_loss("dapo", epsilon_high=0.3, tis_cap=None)
    assert loss_fn == DAPOLoss(epsilon_high=0.3, tis_cap=None)


def test_build_loss_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ConfigError, match=r"unknown loss 'ppo': use one of 'grpo', 'dr_grpo', 'dapo', 'gspo', 'cispo'"):
        build_loss("ppo")


def test_build_loss_unknown_argument_is_named() -> None:
    with pytest.raises(ConfigError, match=r"loss 'grpo' has no argument\(s\) 'epsilon_high': it accepts epsilon, beta"):
        build_loss("grpo", epsilon_high=0.28)


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("grpo", {"epsilon": 1.5}, r"epsilon must be a finite number in \[0.0, 1.0\), got 1.5"),
        ("dapo", {"epsilon_high": -0.1}, r"epsilon_high must be a finite number >= 0.0"),
        ("cispo", {"beta": math.nan}, r"beta must be a finite number"),
        ("gspo", {"tis_cap": 0.5}, r"tis_cap must be a finite number >= 1.0"),
        ("dr_grpo", {"max_tokens": 0}, r"max_tokens must be a positive int"),
    ],
)
def test_out_of_range_arguments_raise(name: str, kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_loss(name, **kwargs)
