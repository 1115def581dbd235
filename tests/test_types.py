"""Trajectory types: JSONL round trip and validation errors that name the trajectory and field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from art_core import CallRecord, History, Trajectory, TrajectoryError, TrajectoryGroup, read_groups_jsonl, write_groups_jsonl


def _full_trajectory() -> Trajectory:
    return Trajectory(
        id="t-full",
        messages=[
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
            {"role": "assistant", "content": "Rain.", "refusal": None},  # provider extras are kept
        ],
        tools=[{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
        calls=[CallRecord(prompt_token_ids=[1, 2], completion_token_ids=[3, 4], logprobs=[-0.5, -0.25],
                          adapter_step=3, finish_reason="tool_calls", request_id="r1", rollout_id="ro1")],
        reward=0.75, metrics={"tool_calls": 1, "ok": True}, metadata={"task": "oslo", "split": None},
        logs=["judge: fine"],
        additional_histories=[History(messages=[{"role": "user", "content": "summary"},
                                                {"role": "assistant", "content": "ok"}])],
    )


def test_jsonl_round_trip(tmp_path):
    groups = [TrajectoryGroup([_full_trajectory(), Trajectory(reward=-1.0)], metadata={"task": "oslo"},
                              exceptions=["TimeoutError: slow tool"]),
              TrajectoryGroup([Trajectory()])]
    path = write_groups_jsonl(tmp_path / "sub" / "groups.jsonl", groups)
    assert read_groups_jsonl(path) == groups
    assert len(path.read_text().splitlines()) == 2
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]  # atomic write left nothing


def test_a_corrupt_line_names_file_line_and_field(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(TrajectoryGroup([Trajectory()]).model_dump_json() + "\n"
                    + '{"trajectories": [{"reward": "high"}]}\n')
    with pytest.raises(TrajectoryError, match=r"g\.jsonl:2.*\n(.|\n)*reward"):
        read_groups_jsonl(path)


def test_validation_names_the_field():
    with pytest.raises(ValidationError, match="rol"):
        Trajectory(messages=[{"rol": "user", "content": "typo"}])
    with pytest.raises(ValidationError, match="rewards"):
        Trajectory(rewards=1.0)  # unknown keys are refused, not dropped
    with pytest.raises(ValidationError, match="completion_token_ids is empty"):
        CallRecord(prompt_token_ids=[1], completion_token_ids=[])
    with pytest.raises(ValidationError, match="'t-inf' has reward inf"):
        Trajectory(id="t-inf", reward=float("inf"))


def test_group_iterates_its_trajectories():
    group = TrajectoryGroup(Trajectory(reward=r) for r in (0.0, 1.0))
    assert len(group) == 2 and [t.reward for t in group] == group.rewards == [0.0, 1.0]
