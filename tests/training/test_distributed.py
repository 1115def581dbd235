"""Splitting a step's groups over trainer ranks (``training/distributed.py``), worked out by hand."""

from __future__ import annotations

import pytest

from art_core import CallRecord, Trajectory, TrajectoryGroup
from art_core.training.distributed import group_tokens, split_groups_by_tokens


def _group(*call_tokens: int) -> TrajectoryGroup:
    """A group with one trajectory per entry, each with one call of that many tokens (prompt 1, rest completion)."""
    return TrajectoryGroup([Trajectory(messages=[], calls=[CallRecord(prompt_token_ids=[0],
                                                                      completion_token_ids=[1] * (n - 1))])
                            for n in call_tokens])


def test_group_tokens_counts_prompt_and_completion_of_every_call() -> None:
    assert group_tokens(_group(3, 5)) == 8


def test_split_balances_tokens_and_keeps_groups_whole() -> None:
    groups = [_group(10), _group(40), _group(30), _group(20)]
    # Largest first to the lightest rank: 40 -> r0, 30 -> r1, 20 -> r1 (30 < 40), 10 -> r0 (40 < 50).
    assert split_groups_by_tokens(groups, 2) == [[0, 1], [2, 3]]
    assert split_groups_by_tokens(groups, 1) == [[0, 1, 2, 3]]


def test_split_with_more_ranks_than_groups_leaves_ranks_empty() -> None:
    assert split_groups_by_tokens([_group(5)], 3) == [[0], [], []]


def test_split_refuses_zero_ranks() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        split_groups_by_tokens([_group(5)], 0)
