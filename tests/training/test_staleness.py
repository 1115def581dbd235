"""Off-policy-aware steps: each group's staleness, the ``max_off_policy`` bound, and the exact correction of a
stale sample (its ratio taken against the sampler's recorded log-probs), checked by hand on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from art_core import CallRecord, ConfigError, TrainConfig, Trajectory, TrajectoryGroup
from art_core.config import LoraSettings
from art_core.training.staleness import StaleGroupsWarning, group_sampling_step, staleness
from art_core.training.trainer import GRPOTrainer, load_policy

PROMPT = list(range(100, 120))
COMPLETIONS = [[201, 202, 203, 2], [301, 302, 2], [401, 402, 403, 404, 2]]
REWARDS = [1.0, 0.0, 0.5]


def _group(step: int | None, logprobs: list[list[float]] | None = None) -> TrajectoryGroup:
    return TrajectoryGroup(
        Trajectory(id=f"s{step}-{i}", reward=REWARDS[i], calls=[CallRecord(
            prompt_token_ids=PROMPT, completion_token_ids=c, adapter_step=step,
            logprobs=logprobs[i] if logprobs else None)])
        for i, c in enumerate(COMPLETIONS))


def test_a_group_is_as_stale_as_its_oldest_call() -> None:
    mixed = TrajectoryGroup([
        Trajectory(calls=[CallRecord(prompt_token_ids=[1], completion_token_ids=[2], adapter_step=4),
                          CallRecord(prompt_token_ids=[1, 2, 3], completion_token_ids=[4], adapter_step=3)]),
        Trajectory(calls=[CallRecord(prompt_token_ids=[1], completion_token_ids=[5], adapter_step=5)])])
    assert group_sampling_step(mixed) == 3
    assert group_sampling_step(_group(None)) is None
    found = staleness([mixed, _group(5), _group(None), _group(1)], policy_step=5, bound=2)
    assert found.per_group == [2, 0, None, 4] and found.stale == [3]
    assert found.metrics() == {"groups_stale": 1.0, "staleness_mean": 2.0, "staleness_max": 4.0,
                               "groups_staleness_unknown": 1.0, "groups_staleness_0": 1.0,
                               "groups_staleness_2": 1.0, "groups_staleness_4": 1.0}
    assert staleness([_group(7)], policy_step=5, bound=0).per_group == [0]  # newer than the module: counts as 0
    assert staleness([_group(0)], policy_step=5, bound=None).stale == []  # no bound: nothing dropped


@pytest.fixture
def trainer(tiny_model_dir) -> GRPOTrainer:
    torch.manual_seed(0)
    model, tokenizer = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    return GRPOTrainer(model, tokenizer)


def test_a_group_past_the_bound_is_dropped_before_its_tokens_are_read_and_counted(trainer) -> None:
    """Policy at step 3, bound 1: the group sampled at step 1 (staleness 2) is dropped, the ones sampled at 2 and 3
    are trained. The stale group's sample is longer than ``max_sequence_length``: reading its tokens would raise,
    so the step succeeding shows it was dropped first."""
    config = TrainConfig(learning_rate=1e-3, max_off_policy=1, max_sequence_length=25)
    too_long = TrajectoryGroup(
        Trajectory(reward=float(i), calls=[CallRecord(prompt_token_ids=list(range(100, 130)),
                                                      completion_token_ids=[7, 2], adapter_step=1)])
        for i in range(2))
    with pytest.warns(StaleGroupsWarning, match=r"1 of 3 group\(s\) .*max_off_policy=1 .*staleness up to 2.*"
                                                r"\(indices \[1\]\)") as caught:
        metrics = trainer.train_step([_group(3), too_long, _group(2)], config, policy_step=3)
    assert [w.filename for w in caught if w.category is StaleGroupsWarning] == [__file__]  # the caller's line
    assert metrics["trained"] == 1.0 and metrics["groups"] == 3 and metrics["groups_used"] == 2
    assert metrics["groups_stale"] == 1 and metrics["groups_dropped"] == 0
    assert (metrics["groups_staleness_0"], metrics["groups_staleness_1"], metrics["groups_staleness_2"]) == (1, 1, 1)
    assert metrics["staleness_max"] == 2 and metrics["staleness_mean"] == pytest.approx(1.0)
    assert metrics["samples"] == 6 and metrics["samples_off_policy"] == 3  # step 2's group is off-policy


def test_every_group_stale_trains_nothing(trainer) -> None:
    with pytest.warns(StaleGroupsWarning, match="1 of 1 group"):
        metrics = trainer.train_step([_group(0)], TrainConfig(max_off_policy=0), policy_step=1)
    assert metrics["trained"] == 0.0 and metrics["groups_stale"] == 1 and metrics["groups_used"] == 0


def test_a_bound_without_policy_step_is_refused(trainer) -> None:
    with pytest.raises(ConfigError, match=r"max_off_policy=1\) needs train_step\(policy_step=...\)"):
        trainer.train_step([_group(0)], TrainConfig(max_off_policy=1))
    with pytest.raises(ValidationError, match="max_off_policy"):
        TrainConfig(max_off_policy=-1)


@torch.no_grad()
def _token_logprobs(model, completion: list[int]) -> torch.Tensor:
    """``[len(completion)]`` the module's log-prob of each completion token after the prompt."""
    ids = torch.tensor([PROMPT + completion])
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    return logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]][len(PROMPT) - 1:]


@pytest.mark.parametrize(("trust_region", "steps", "clipped_by_hand"), [("fixed", 1, 4 + 3), ("compounded", 3, 0)])
def test_a_stale_samples_loss_uses_the_sampler_logprobs_recorded(trainer, trust_region, steps,
                                                                 clipped_by_hand) -> None:
    """DAPO (token mean, clip 1-0.2 .. 1+0.28), advantages centred only, no TIS: worked out with torch from the
    recorded log-probs and a forward pass of the module, then compared with the step's loss, ratio and clip share.

    The recorded log-probs sit at offsets from the module's own, so each token's ratio pi/pi_sampler is
    exp(-offset): 1.5, 0.7 and 1.1. The group was sampled 2 steps before the one training. With the ``"fixed"``
    trust region its range is one step's, [0.8, 1.28]: 1.5 is clipped above for the positive advantage, 0.7 below
    for the negative one. ``"compounded"`` (the default) spans those 2 steps and this one, [0.8^3, 1.28^3] =
    [0.512, 2.097]: every token keeps its gradient."""
    offsets = [[-math.log(1.5)] * 4, [-math.log(0.7)] * 3, [-math.log(1.1)] * 5]
    current = [_token_logprobs(trainer.model, c) for c in COMPLETIONS]
    recorded = [(lp + torch.tensor(off)).tolist() for lp, off in zip(current, offsets)]
    config = TrainConfig(learning_rate=1e-9, loss="dapo", advantage_scale="none", tis_cap=None, max_off_policy=2,
                         off_policy_baseline="sampled", off_policy_trust_region=trust_region)

    # By hand: A_i = r_i - mean(r) = (0.5, -0.5, 0); per token -min(r A, clip(r, lo, hi) A); mean over 12 tokens.
    lo, hi = 0.8 ** steps, 1.28 ** steps
    mean = sum(REWARDS) / 3
    losses, ratios, clipped = [], [], 0
    for lp, rec, reward in zip(current, recorded, REWARDS):
        ratio = torch.exp(lp - torch.tensor(rec))  # [T_i]
        advantage = reward - mean
        surrogate = torch.minimum(ratio * advantage, ratio.clamp(lo, hi) * advantage)
        clipped += int(((ratio.clamp(lo, hi) * advantage) < ratio * advantage).sum())
        losses.append(-surrogate)
        ratios.append(ratio)
    tokens = sum(len(c) for c in COMPLETIONS)
    expected_loss = float(torch.cat(losses).sum() / tokens)
    assert clipped == clipped_by_hand  # fixed: the first two trajectories' tokens, where the clipped term won

    metrics = trainer.train_step([_group(1, recorded)], config, policy_step=3)  # sampled 2 steps ago
    assert metrics["groups_staleness_2"] == 1 and metrics["samples_off_policy"] == 3
    assert metrics["loss"] == pytest.approx(expected_loss, abs=1e-5)
    assert metrics["ratio_mean"] == pytest.approx(float(torch.cat(ratios).mean()), abs=1e-5)
    assert metrics["ratio_max"] == pytest.approx(1.5, abs=1e-4) and metrics["ratio_min"] == pytest.approx(0.7, abs=1e-4)
    assert metrics["clip_fraction"] == pytest.approx(clipped / tokens)

    # The same data counted as on-policy (sampled by the current step): ratio 1, loss -mean(A) per token.
    fresh = trainer.train_step([_group(3, recorded)], config, policy_step=3)
    assert fresh["samples_off_policy"] == 0 and fresh["ratio_mean"] == 1.0
    on_policy = -sum((r - mean) * len(c) for r, c in zip(REWARDS, COMPLETIONS)) / tokens
    assert fresh["loss"] == pytest.approx(on_policy, abs=1e-6)


def test_the_weight_correction_keeps_every_stale_token_weighed_by_its_sampler_ratio(trainer) -> None:
    """``off_policy_correction="weight"`` (the decoupled objective), on the data above: the ratio is taken against
    the current policy (1 in value, nothing clipped), and each stale token's loss is weighed by
    min(pi/pi_sampler, tis_cap): 1.5 capped at 1.2, 0.7 and 1.1. By hand: -sum(w A) over the 12 tokens / 12."""
    offsets = [[-math.log(1.5)] * 4, [-math.log(0.7)] * 3, [-math.log(1.1)] * 5]
    current = [_token_logprobs(trainer.model, c) for c in COMPLETIONS]
    recorded = [(lp + torch.tensor(off)).tolist() for lp, off in zip(current, offsets)]
    config = TrainConfig(learning_rate=1e-9, loss="dapo", advantage_scale="none", tis_cap=1.2, max_off_policy=2,
                         off_policy_correction="weight", off_policy_baseline="sampled")
    mean = sum(REWARDS) / 3
    tokens = sum(len(c) for c in COMPLETIONS)
    expected = -sum(w * (r - mean) * len(c) for w, r, c in zip([1.2, 0.7, 1.1], REWARDS, COMPLETIONS)) / tokens

    metrics = trainer.train_step([_group(1, recorded)], config, policy_step=3)
    assert metrics["groups_staleness_2"] == 1 and metrics["samples_off_policy"] == 3
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_fraction"] == 0.0
    assert metrics["loss"] == pytest.approx(expected, abs=1e-5)
    assert metrics["is_truncated_fraction"] == pytest.approx(4 / tokens)  # the first trajectory's tokens
    assert metrics["is_weight_mean"] == pytest.approx((1.2 * 4 + 0.7 * 3 + 1.1 * 5) / tokens, abs=1e-5)


def test_the_weight_correction_needs_a_cap() -> None:
    with pytest.raises(ValidationError, match=r"tis_cap=None turns it off|tis_cap=None turns off"):
        TrainConfig(off_policy_correction="weight", tis_cap=None)


LONG = [[201 + i for i in range(9)] + [2], [301 + i for i in range(7)] + [2], [401 + i for i in range(8)] + [2]]


@pytest.mark.parametrize("completions", [COMPLETIONS, LONG], ids=["one-micro-batch", "split-over-micro-batches"])
def test_a_stale_groups_advantages_are_centred_on_what_the_current_policy_expects(trainer, completions) -> None:
    """``off_policy_baseline="reweighted"`` (the default), the recorded log-probs offset from the module's own so
    that each token's ratio pi/pi_sampler is 1.5, 0.7 or 1.1 by trajectory: each trajectory's importance weight is
    the product over its tokens, normalised over the group; the baseline b = sum w_i A_i comes off every
    advantage, then DAPO as before. The current adapter favours the best answer (reward 1) most, so b > 0: the
    good answer is pushed less, the bad ones more. With completions of 8-10 tokens the group's samples no longer
    fit one micro-batch of 16 tokens, and the weights come from a forward pass before the step: the same loss."""
    ratios = [1.5, 0.7, 1.1]
    current = [_token_logprobs(trainer.model, c) for c in completions]
    recorded = [(lp - math.log(r)).tolist() for lp, r in zip(current, ratios)]
    group = TrajectoryGroup(
        Trajectory(id=f"t{i}", reward=REWARDS[i], calls=[CallRecord(
            prompt_token_ids=PROMPT, completion_token_ids=c, adapter_step=1, logprobs=recorded[i])])
        for i, c in enumerate(completions))
    config = TrainConfig(learning_rate=1e-9, loss="dapo", advantage_scale="none", tis_cap=None, max_off_policy=2,
                         micro_batch_tokens=16)
    assert config.off_policy_baseline == "reweighted"

    mean = sum(REWARDS) / 3
    weights = torch.softmax(torch.tensor([len(c) * math.log(r) for c, r in zip(completions, ratios)]), 0)
    baseline = float(sum(w * (r - mean) for w, r in zip(weights.tolist(), REWARDS)))
    if completions is COMPLETIONS:  # weights 1.5^4, 0.7^3, 1.1^5 normalised: (0.72, 0.05, 0.23)
        assert baseline == pytest.approx(0.3363, abs=1e-4)
    losses = []
    for lp, rec, reward in zip(current, recorded, REWARDS):
        ratio = torch.exp(lp - torch.tensor(rec))
        advantage = reward - mean - baseline  # the clip range spans the 2 steps since sampling and this one
        losses.append(-torch.minimum(ratio * advantage, ratio.clamp(0.8 ** 3, 1.28 ** 3) * advantage))
    tokens = sum(len(c) for c in completions)
    expected = float(torch.cat(losses).sum() / tokens)

    metrics = trainer.train_step([group], config, policy_step=3)  # sampled 2 steps ago
    assert metrics["micro_batches"] == (1 if completions is COMPLETIONS else 3)
    assert metrics["groups_recentred"] == 1 and metrics["stale_baseline_mean"] == pytest.approx(baseline, abs=1e-5)
    assert metrics["loss"] == pytest.approx(expected, abs=1e-5)

    # The same group counted as fresh is not touched: its trajectories all weigh 1, its advantages are centred.
    for t in group.trajectories:
        t.calls[0].adapter_step = 3
    fresh = trainer.train_step([group], config, policy_step=3)
    assert fresh["groups_recentred"] == 0 and fresh["stale_baseline_mean"] == 0.0
    assert fresh["loss"] == pytest.approx(-sum((r - mean) * len(c) for r, c in zip(REWARDS, completions)) / tokens,
                                          abs=1e-6)

