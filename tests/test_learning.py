"""Learning on the embedded SmolLM2-135M: GRPO must raise the held-out success rate on the built-in task.

Slow (several minutes on 2 cores); CI runs it. Sampling at temperature 0.7, the base model answers about
a fifth of the held-out addition questions right (160 answers: 40 questions x 4); 10 GRPO steps must
raise that success rate measurably: by at least 8 points, more than twice its standard error (~3 points).
"""

from __future__ import annotations

import json

import pytest

from art_core import TrainConfig
from art_core.demo import run_demo


@pytest.mark.slow
@pytest.mark.timeout(2400)  # ~4 min on a quiet 2-core machine; much longer when it is shared
async def test_ten_grpo_steps_raise_held_out_success(smollm2_dir, tmp_path):
    result = await run_demo(steps=10, base_model=smollm2_dir, path=tmp_path, seed=0,
                            config=TrainConfig(learning_rate=1e-3))
    summary = {"success_before": result.success_before, "success_after": result.success_after,
               "train_reward_per_step": result.rewards, "seconds": result.seconds}
    (tmp_path / "result.json").write_text(json.dumps(summary))  # pytest keeps tmp_path for inspection
    print(summary)
    assert 0.10 <= result.success_before <= 0.40  # the task is in the band where GRPO has signal
    assert result.success_after >= result.success_before + 0.08
    assert sum(result.rewards[-3:]) > sum(result.rewards[:3])  # training reward rose too
