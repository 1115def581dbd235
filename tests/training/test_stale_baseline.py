"""``StaleBaselines``: a stale group's advantages re-centred on the current policy's expected reward, by hand on
samples planned into micro-batches (no model: the current log-probs are given)."""

from __future__ import annotations

import math

import pytest
import torch

from art_core.training.batching import plan_micro_batches
from art_core.training.samples import Sample
from art_core.training.stale_baseline import StaleBaselines

PROMPT = list(range(100, 120))


def _sample(trajectory: str, group: int, advantage: float, completion: list[int], behaviour: float | None,
            prompt: list[int] = PROMPT) -> Sample:
    """A sample whose every completion token was sampled with log-prob ``behaviour`` (None: fresh)."""
    n = len(prompt) + len(completion)
    trained = [False] * len(prompt) + [True] * len(completion)
    logprobs = [math.nan] * len(prompt) + [behaviour if behaviour is not None else -1.0] * len(completion)
    return Sample(trajectory, prompt + completion, trained, logprobs, advantage=advantage, group_index=group,
                  behaviour_logprobs=None if behaviour is None else logprobs)


def _current(mb, per_trajectory: dict[str, float]) -> torch.Tensor:
    """``[B, T]`` current log-probs: each row's trajectory's value on every position."""
    return torch.tensor([[per_trajectory[s.trajectory_id]] * mb.input_ids.shape[1] for s in mb.samples])


def test_a_stale_groups_advantages_come_down_by_the_weighted_mean_and_a_fresh_groups_stay() -> None:
    """Stale group 0: trajectories a (A=+1, 2 tokens) and b (A=-1, 1 token), sampled at log-prob -1 per token; the
    current policy gives a's tokens -0.5 and b's -1.5, so log-weights 2 * 0.5 = 1 and -0.5, weights
    softmax(1, -0.5) = (0.818, 0.182), b = 0.818 - 0.182 = 0.635. Fresh group 1 is left alone."""
    samples = [_sample("a", 0, 1.0, [5, 6], -1.0), _sample("b", 0, -1.0, [7], -1.0),
               _sample("c", 1, 0.5, [8], None), _sample("d", 1, -0.5, [9], None)]
    plan = plan_micro_batches([samples[:2], samples[2:]], token_budget=4096)
    baselines = StaleBaselines(samples, plan)
    assert baselines and baselines.split == set()

    expected_shift = math.tanh(0.75)  # softmax-weighted mean of (+1, -1) with log-weights 1 and -0.5
    for pg in plan:
        for mb in pg.micro_batches:
            current = _current(mb, {"a": -0.5, "b": -1.5, "c": -1.0, "d": -1.0})
            got = baselines.advantages(mb, current)
            for row, s in enumerate(mb.samples):
                trained = mb.trained[row] > 0
                want = s.advantage - (expected_shift if s.group_index == 0 else 0.0)
                assert torch.allclose(got[row][trained], torch.full_like(got[row][trained], want), atol=1e-6)
                assert torch.equal(got[row][~trained], mb.advantages[row][~trained])  # untrained positions as given
    assert [float(b) for b in baselines.shifts] == pytest.approx([expected_shift], abs=1e-6)


def test_a_trajectory_spread_over_micro_batches_weighs_all_its_turns() -> None:
    """Trajectory a has two turns, and a token budget of 8 puts the group in two micro-batches: a's log-weight is the
    sum over both turns. With ``extra_pass=False`` (an FSDP rank) the group is left as sampled instead."""
    second_prompt = PROMPT + [5, 6, 50, 51]
    samples = [_sample("a", 0, 1.0, [5, 6], -1.0), _sample("a", 0, 1.0, [7], -1.0, prompt=second_prompt),
               _sample("b", 0, -1.0, [8], -1.0)]
    plan = plan_micro_batches([samples], token_budget=8)
    assert sum(len(pg.micro_batches) for pg in plan) == 2

    assert not StaleBaselines(samples, plan, extra_pass=False)  # nothing it may re-centre: the caller drops it

    baselines = StaleBaselines(samples, plan)
    assert baselines.split == {0}
    values = {"a": -0.5, "b": -1.0}  # a: 3 tokens at +0.5 each (log-weight 1.5), b: 0
    for pg in plan:  # what the forward pass before the step does
        for mb in pg.micro_batches:
            baselines.add_log_weights(mb, _current(mb, values))
    weights = torch.softmax(torch.tensor([1.5, 0.0]), 0)
    shift = float(weights[0] - weights[1])
    for mb in plan[0].micro_batches:  # both turns of a, and b, shift alike
        got = baselines.advantages(mb, _current(mb, values))
        for row, s in enumerate(mb.samples):
            want = s.advantage - shift
            assert float(got[row][mb.trained[row] > 0].max()) == pytest.approx(want, abs=1e-6)
            assert float(got[row][mb.trained[row] > 0].min()) == pytest.approx(want, abs=1e-6)
    assert [float(b) for b in baselines.shifts] == pytest.approx([shift], abs=1e-6)
