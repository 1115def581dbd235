"""score_group: custom reward functions (sync and async), weights, and RULER as one more component."""

from __future__ import annotations

import asyncio
import functools

import pytest

from art_core import RewardError, ruler_score_group, score_group
from art_core.errors import ConfigError
from art_core.types import TrajectoryGroup

ORIGINAL = [0.5, 1.5, 2.5]  # capital_group's rewards


def says_paris(trajectory, state) -> float:
    return float("Paris" in trajectory.messages[-1].text())


async def short(trajectory, state) -> float:
    await asyncio.sleep(0)
    return 1.0 if len(trajectory.messages[-1].text()) < 20 else 0.0


async def test_components_are_kept_and_weighted(group):
    states = [{"tokens": 10}, {"tokens": 30}, {"tokens": 5}]
    scored = await score_group(group, {"correct": says_paris, "short": short,
                                       "cheap": lambda t, state: state["tokens"] <= 10},
                               weights={"correct": 1.0, "short": 0.5, "cheap": -0.25}, final_states=states)
    # correct, short, cheap per run: Paris (1, 0, 1), Lyon (0, 0, 0), "I do not know." (0, 1, 1)
    # rewards: 1 - 0.25 = 0.75; 0; 0.5 - 0.25 = 0.25
    assert scored.rewards == [0.75, 0.0, 0.25]
    paris = scored.trajectories[0].metrics
    assert (paris["correct"], paris["short"], paris["cheap"]) == (1.0, 0.0, 1.0)
    assert [t.metrics["reward_before_rewards"] for t in scored] == ORIGINAL
    assert group.rewards == ORIGINAL  # a copy was scored


async def test_unweighted_components_weigh_one(group):
    scored = await score_group(group, {"correct": says_paris, "short": short})
    assert scored.rewards == [1.0, 0.0, 1.0]


async def test_ruler_is_one_more_component(fake_judge, group, tmp_path):
    ruler = functools.partial(ruler_score_group, judge="openai/judge", api_base=fake_judge.base_url, api_key="x",
                              cache_dir=tmp_path, completion_kwargs={"max_retries": 0})
    scored = await score_group(group, {"short": short}, weights={"ruler": 2.0, "short": 1.0}, ruler=ruler)
    # ruler (fake judge): Paris 1.0, Lyon 0.3, none 0.0; short: 0, 0, 1
    assert scored.rewards == pytest.approx([2.0, 0.6, 1.0])
    first = scored.trajectories[0]
    assert first.metrics["ruler_score"] == 1.0 and first.metrics["short"] == 0.0
    assert first.metrics["reward_before_rewards"] == first.metrics["reward_before_ruler"] == 0.5
    assert any(line.startswith("RULER") for line in first.logs)


async def test_a_failing_ruler_swallowed_gives_none(fake_judge, group, tmp_path):
    fake_judge.default = "broken"
    ruler = functools.partial(ruler_score_group, judge="openai/judge", api_base=fake_judge.base_url, api_key="x",
                              cache_dir=None, max_repairs=0, swallow_exceptions=True,
                              completion_kwargs={"max_retries": 0})
    assert await score_group(group, {"short": short}, ruler=ruler) is None
    assert group.rewards == ORIGINAL


async def test_a_failing_function_names_itself_and_changes_nothing(group):
    def boom(trajectory, state):
        raise KeyError("answer")

    with pytest.raises(RewardError, match=r"reward 'boom' failed on trajectory 'run-0': KeyError"):
        await score_group(group, {"correct": says_paris, "boom": boom})
    with pytest.raises(RewardError, match=r"reward 'nan' returned nan for trajectory 'run-0'"):
        await score_group(group, {"nan": lambda t, s: float("nan")})
    with pytest.raises(RewardError, match=r"returned None"):
        await score_group(group, {"none": lambda t, s: None})
    assert group.rewards == ORIGINAL and not any(t.metrics for t in group)


async def test_the_first_failure_cancels_the_other_components_calls(group):
    """A grader still waiting (an LLM call, say) is cancelled when another component fails, not left running."""
    started, cancelled = asyncio.Event(), []

    async def slow_grader(trajectory, state):
        started.set()
        try:
            await asyncio.Event().wait()  # answers only when cancelled
        except asyncio.CancelledError:
            cancelled.append(trajectory.id)
            raise
        return 1.0

    async def broken(trajectory, state):
        await started.wait()  # the graders are waiting by then
        raise KeyError("expected")

    with pytest.raises(RewardError, match="reward 'broken' failed"):
        await score_group(group, {"grader": slow_grader, "broken": broken})
    assert sorted(cancelled) == sorted(t.id for t in group)  # all three stopped before score_group raised


async def test_numpy_and_torch_scalars_are_numbers(group):
    import numpy as np
    import torch

    scored = await score_group(group, {"f32": lambda t, s: np.float32(0.5), "i64": lambda t, s: np.int64(1),
                                       "flag": lambda t, s: np.bool_(True), "tensor": lambda t, s: torch.tensor(0.25)})
    assert scored.rewards == [2.75, 2.75, 2.75]
    with pytest.raises(RewardError, match=r"returned array\(\[0.5, 0.5\]"):
        await score_group(group, {"vector": lambda t, s: np.array([0.5, 0.5])})


async def test_misuse_is_refused(group):
    with pytest.raises(ConfigError, match=r"weights name 'corect', which is no component"):
        await score_group(group, {"correct": says_paris}, weights={"corect": 1.0})
    with pytest.raises(ConfigError, match=r"final_states has 2 entries for a group of 3"):
        await score_group(group, {"correct": says_paris}, final_states=[1, 2])
    with pytest.raises(ConfigError, match=r"no reward components"):
        await score_group(group, {})
    with pytest.raises(RewardError, match="no trajectories"):
        await score_group(TrajectoryGroup([]), {"correct": says_paris})
