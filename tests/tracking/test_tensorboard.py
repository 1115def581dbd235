"""TensorBoard: the event files a model writes, read back with TensorBoard's own ``EventAccumulator``."""

from __future__ import annotations

import json
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from tracked_steps import SFT_MODEL, sft_then_grpo, train_twice


def _scalars(accumulator: EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in accumulator.Tensors(tag)}


def _texts(accumulator: EventAccumulator, tag: str) -> dict[int, str]:
    return {e.step: tensor_util.make_ndarray(e.tensor_proto).item().decode() for e in accumulator.Tensors(tag)}


async def test_steps_config_and_table_reach_tensorboard_and_a_resumed_model_continues_the_run(tiny_model_dir, tmp_path):
    await train_twice(tmp_path, tiny_model_dir, lambda: "tensorboard", resumed_learning_rate=2e-3)

    folder = tmp_path / "tracking" / "models" / "tracked" / "tracking"
    run_id = json.loads((folder / "runs.json").read_text())["tensorboard"]
    run_dirs = [p for p in (folder / "tensorboard").iterdir() if p.is_dir()]
    assert [p.name for p in run_dirs] == [run_id]  # one run, whose folder got the resumed model's events too
    assert len(list(Path(run_dirs[0]).glob("events.out.tfevents.*"))) == 2

    accumulator = EventAccumulator(str(run_dirs[0]), size_guidance={"tensors": 0})
    accumulator.Reload()
    rewards = _scalars(accumulator, "train/reward_mean")
    assert sorted(rewards) == [1, 2, 3]
    assert all(abs(v - 0.4375) < 1e-6 for v in rewards.values())  # mean of 0, 1, 0.5, 0.25
    assert set(_scalars(accumulator, "rollout/success_mean").values()) == {0.25}
    for tag in ("train/loss", "train/grad_norm", "train/kl", "train/trained_tokens", "train/groups_dropped",
                "time/forward_backward", "time/step", "rollout/completion_tokens_mean"):
        assert sorted(_scalars(accumulator, tag)) == [1, 2, 3], tag
    # The time between steps: from a model's 2nd step on (the resumed model's first step has no "before")
    assert sorted(_scalars(accumulator, "time/rollouts")) == [2]
    config = {step: json.loads(text.removeprefix("```json\n").removesuffix("\n```"))
              for step, text in _texts(accumulator, "config").items()}
    assert sorted(config) == [0, 3]  # when the run was made, and at the resumed model's first step
    assert config[0]["lora"]["rank"] == 8 and config[0]["train"]["learning_rate"] == 1e-3
    assert config[3]["train"]["learning_rate"] == 2e-3  # the setting changed across the resume
    table = _texts(accumulator, "trajectories")
    assert sorted(table) == [1, 2, 3]
    assert "| best |" in table[1] and "| worst |" in table[1] and "trace-1" in table[1]
    assert "user: Name a color." in table[3]


async def test_sft_then_grpo_writes_the_config_again_at_each_step_that_changed_it(tiny_model_dir, tmp_path):
    await sft_then_grpo(tmp_path, tiny_model_dir, lambda: "tensorboard")

    [run_dir] = (tmp_path / "tracking" / "models" / SFT_MODEL / "tracking" / "tensorboard").iterdir()
    accumulator = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    accumulator.Reload()
    config = {step: json.loads(text.removeprefix("```json\n").removesuffix("\n```"))
              for step, text in _texts(accumulator, "config").items()}
    assert sorted(config) == [0, 2, 3]  # made at the SFT step; GRPO added its section at 2, a new rate at 3
    assert list(config[0]).count("sft") == 1 and "train" not in config[0]
    assert config[2]["sft"]["learning_rate"] == 5e-4 and config[2]["train"]["learning_rate"] == 1e-3
    assert config[3]["train"]["learning_rate"] == 2e-3
