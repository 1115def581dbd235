"""Each example runs end to end: one tiny GRPO step on the tiny random model, held-out evaluation included.

The tiny model's answers are noise, so these tests check the plumbing (the agent runs on the gateway,
trajectories reach the trainer and the disk, the curve and the result file are written), not learning:
``tests/test_learning.py`` and ``tests/benchmarks/learning.py`` measure that on the embedded model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from examples._common import ExampleSettings, sparkline

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def tiny(model_dir: Path, path: Path, **more) -> ExampleSettings:
    return ExampleSettings(base_model=str(model_dir), steps=1, groups=1, rollouts=2, held_out=1, eval_rollouts=1,
                           path=path, **more)


def check_run(result, steps: int = 1) -> None:
    assert len(result.steps) == steps
    assert 0.0 <= result.success_before <= 1.0 and 0.0 <= result.success_after <= 1.0
    assert list((result.model_dir / "trajectories").glob("*.jsonl")), "the step's trajectories were not written"
    saved = json.loads((result.model_dir / "learning_result.json").read_text())
    assert saved["success_after"] == result.success_after
    assert result.curve_png is not None and result.curve_png.stat().st_size > 1000


async def test_langgraph_tools(tiny_model_dir, tmp_path):
    from examples import langgraph_tools

    result = await langgraph_tools.run(tiny(tiny_model_dir, tmp_path))
    check_run(result)


async def test_an_example_reports_to_the_trackers_report_to_names(tiny_model_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from examples import tic_tac_toe
    from examples._common import parse_settings

    settings = parse_settings("tic-tac-toe", tiny(tiny_model_dir, tmp_path), ["--report-to", "tensorboard"])
    assert settings.report_to == ("tensorboard",)
    result = await tic_tac_toe.run(settings)
    check_run(result)
    (run_dir,) = (result.model_dir / "tracking" / "tensorboard").iterdir()
    accumulator = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    accumulator.Reload()
    # One report, at the model's step after the call (0 when the tiny model's rollouts all scored alike)
    history = [json.loads(line) for line in (result.model_dir / "history.jsonl").read_text().splitlines()]
    assert [e.step for e in accumulator.Tensors("train/reward_mean")] == [history[-1]["step"]]
    assert len(accumulator.Tensors("rollout/success_mean")) == 1


def test_report_to_flag_takes_several_trackers_and_refuses_unknown_ones(tmp_path, capsys):
    from examples._common import parse_settings

    settings = parse_settings("x", ExampleSettings(path=tmp_path), ["--report-to", "tensorboard", "mlflow"])
    assert settings.report_to == ("tensorboard", "mlflow")
    assert parse_settings("x", ExampleSettings(path=tmp_path), []).report_to == ()
    with pytest.raises(SystemExit):
        parse_settings("x", ExampleSettings(path=tmp_path), ["--report-to", "comet"])
    assert "invalid choice: 'comet'" in capsys.readouterr().err


def test_sparkline_spans_lowest_to_highest():
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([2.0, 2.0]) == "▁▁"
    assert sparkline([]) == ""


async def test_tic_tac_toe(tiny_model_dir, tmp_path):
    from examples import tic_tac_toe

    result = await tic_tac_toe.run(tiny(tiny_model_dir, tmp_path))
    check_run(result)


async def test_game_2048(tiny_model_dir, tmp_path):
    from examples import game_2048

    result = await game_2048.run(tiny(tiny_model_dir, tmp_path))
    check_run(result)


def test_2048_slides_and_merges_once():
    from examples.game_2048.agent import slide

    board = [[2, 2, 2], [4, 0, 4], [0, 0, 2]]
    assert slide(board, "left") == [[4, 2, 0], [8, 0, 0], [2, 0, 0]]
    assert slide(board, "right") == [[0, 2, 4], [0, 0, 8], [0, 0, 2]]
    assert slide(board, "up") == board  # nothing can move up: a wasted move
    assert slide([[2, 0, 0], [2, 0, 0], [4, 0, 0]], "up") == [[4, 0, 0], [4, 0, 0], [0, 0, 0]]
    assert slide([[2, 0, 0], [2, 0, 0], [4, 0, 0]], "down") == [[0, 0, 0], [4, 0, 0], [4, 0, 0]]


def test_tic_tac_toe_rewards_follow_the_outcome():
    from art_core import Trajectory
    from examples.tic_tac_toe.agent import reward, winner

    assert winner(list("XXX.O.O..")) == "X" and winner(list("XO.OX...X")) == "X" and winner(list(".........")) is None
    scores = {outcome: reward(Trajectory(messages=[{"role": "user", "content": "?"}]), {"outcome": outcome, "turn": 2})
              for outcome in ("win", "draw", "loss", "invalid")}
    assert scores == {"win": 1.0, "draw": 0.5, "loss": 0.0, "invalid": -1.0}


async def test_agents_sdk_support(tiny_model_dir, tmp_path):
    from examples import agents_sdk_support

    result = await agents_sdk_support.run(tiny(tiny_model_dir, tmp_path))
    check_run(result)


async def test_ruler_only(tiny_model_dir, tmp_path):
    from examples import ruler_only

    result = await ruler_only.run(tiny(tiny_model_dir, tmp_path, judge="local"))
    check_run(result)
    trained = (result.model_dir / "trajectories" / "0001.jsonl").read_text()
    assert "ruler_score" in trained  # the rewards came from the judge
