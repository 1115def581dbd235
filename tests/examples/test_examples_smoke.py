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


def test_sparkline_spans_lowest_to_highest():
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([2.0, 2.0]) == "▁▁"
    assert sparkline([]) == ""
