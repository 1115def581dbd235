"""Rewards test set-up: a scripted judge on loopback (``fake_judges.py`` says why a fake) and a group."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_judges import FakeJudge, capital_group

from art_core.types import TrajectoryGroup


@pytest.fixture
def fake_judge() -> Iterator[FakeJudge]:
    judge = FakeJudge()
    try:
        yield judge
    finally:
        judge.close()


@pytest.fixture
def group() -> TrajectoryGroup:
    return capital_group()
