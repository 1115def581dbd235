"""Learning on the embedded SmolLM2-135M: GRPO must raise held-out accuracy on the built-in task.

Slow (several minutes on 2 cores); CI runs it. The base model answers about a third of the held-out
addition questions right (greedy); 10 GRPO steps must raise that measurably.
"""

from __future__ import annotations

import pytest

from art_core import TrainConfig
from art_core.demo import run_demo


@pytest.mark.slow
async def test_ten_grpo_steps_raise_held_out_accuracy(smollm2_dir, tmp_path):
    result = await run_demo(steps=10, base_model=smollm2_dir, path=tmp_path, seed=0,
                            config=TrainConfig(learning_rate=1e-3))
    print(f"held-out accuracy {result.accuracy_before:.3f} -> {result.accuracy_after:.3f}, "
          f"train reward per step {[round(r, 3) for r in result.rewards]}, {result.seconds:.0f}s")
    assert 0.10 <= result.accuracy_before <= 0.40  # the task is in the band where GRPO has signal
    assert result.accuracy_after >= result.accuracy_before + 0.15
