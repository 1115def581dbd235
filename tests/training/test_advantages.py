"""Group-relative advantages, checked against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from art_core.errors import ConfigError, TrajectoryError
from art_core.training.advantages import GroupAdvantages, compute_group_advantages


def assert_group_close(actual: list[float] | None, expected: list[float]) -> None:
    assert actual is not None
    torch.testing.assert_close(torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64))


def test_group_scale_divides_by_the_group_std() -> None:
    # rewards [0, 0, 3]: mean 1, deviations [-1, -1, 2]
    # population variance (1 + 1 + 4) / 3 = 2, std sqrt(2) = 1.414214
    # A = [-1, -1, 2] / sqrt(2) = [-0.707107, -0.707107, 1.414214]   (eps=0)
    out = compute_group_advantages([[0.0, 0.0, 3.0]], scale="group", eps=0.0)
    assert_group_close(out.advantages[0], [-1 / math.sqrt(2), -1 / math.sqrt(2), math.sqrt(2)])
    assert out.dropped_groups == []


def test_group_scale_adds_eps_to_the_std() -> None:
    # rewards [0, 2]: mean 1, deviations [-1, 1], std 1; with eps=1 the divisor is 2 -> [-0.5, 0.5]
    out = compute_group_advantages([[0.0, 2.0]], scale="group", eps=1.0)
    assert_group_close(out.advantages[0], [-0.5, 0.5])


def test_batch_scale_uses_group_mean_and_std_of_kept_groups() -> None:
    # group 0 [0, 2] (mean 1), group 1 [5, 5] dropped (no spread), group 2 [3, 7] (mean 5)
    # kept rewards [0, 2, 3, 7]: mean 3, deviations [-3, -1, 0, 4]
    # population variance (9 + 1 + 0 + 16) / 4 = 6.5, std sqrt(6.5) = 2.549510
    # group 0: [-1, 1] / 2.549510 = [-0.392232, 0.392232]
    # group 2: [-2, 2] / 2.549510 = [-0.784465, 0.784465]   (group scale would give +-1 for both)
    out = compute_group_advantages([[0.0, 2.0], [5.0, 5.0], [3.0, 7.0]], scale="batch", eps=0.0)
    std = math.sqrt(6.5)
    assert_group_close(out.advantages[0], [-1 / std, 1 / std])
    assert out.advantages[1] is None
    assert_group_close(out.advantages[2], [-2 / std, 2 / std])
    assert out.dropped_groups == [1]
    assert out.scale_std == pytest.approx(std)


def test_none_scale_only_centres() -> None:
    # rewards [0, 1, 5]: mean 2 -> [-2, -1, 3]   (Dr. GRPO: no std division)
    out = compute_group_advantages([[0.0, 1.0, 5.0]], scale="none")
    assert_group_close(out.advantages[0], [-2.0, -1.0, 3.0])
    assert math.isnan(out.scale_std)


def test_zero_variance_groups_are_dropped_and_listed() -> None:
    # group 0 all equal; group 2 differs by 1e-9 < 1e-8, which counts as equal
    out = compute_group_advantages([[1.0, 1.0, 1.0], [0.0, 1.0], [0.5, 0.5 + 1e-9]])
    assert out.advantages[0] is None and out.advantages[2] is None
    assert out.dropped_groups == [0, 2]
    assert out.num_kept == 1
    # group 1 [0, 1]: mean 0.5, std 0.5 -> [-0.5, 0.5] / (0.5 + 1e-6) = [-0.999998, 0.999998]
    assert_group_close(out.advantages[1], [-0.5 / (0.5 + 1e-6), 0.5 / (0.5 + 1e-6)])


def test_single_trajectory_group_is_dropped() -> None:
    out = compute_group_advantages([[1.0], [0.0, 1.0]], scale="none")
    assert out.advantages[0] is None
    assert out.dropped_groups == [0]
    assert_group_close(out.advantages[1], [-0.5, 0.5])


def test_reward_stats_cover_every_trajectory_including_dropped() -> None:
    # rewards [1, 1] (dropped) and [0, 2]: all four are [1, 1, 0, 2]
    # mean 1, deviations [0, 0, -1, 1], population variance 2/4 = 0.5, std 0.707107
    out = compute_group_advantages([[1.0, 1.0], [0.0, 2.0]])
    assert out.reward_mean == pytest.approx(1.0)
    assert out.reward_std == pytest.approx(math.sqrt(0.5))


def test_empty_input_gives_empty_result() -> None:
    out = compute_group_advantages([])
    assert isinstance(out, GroupAdvantages)
    assert out.advantages == [] and out.dropped_groups == []
    assert math.isnan(out.reward_mean) and math.isnan(out.reward_std)


def test_empty_group_raises_naming_the_group() -> None:
    with pytest.raises(TrajectoryError, match=r"group 1 has no rewards.*drop empty groups.*failed"):
        compute_group_advantages([[0.0, 1.0], []])


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_reward_raises_naming_group_and_trajectory(bad: float) -> None:
    with pytest.raises(TrajectoryError, match=r"group 1, trajectory 2 has a non-finite reward"):
        compute_group_advantages([[0.0, 1.0], [0.0, 1.0, bad]])


def test_bad_scale_or_eps_raises_config_error() -> None:
    with pytest.raises(ConfigError, match=r"'group', 'batch', 'none'"):
        compute_group_advantages([[0.0, 1.0]], scale="std")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"eps must be a finite number >= 0, got -1"):
        compute_group_advantages([[0.0, 1.0]], eps=-1.0)
