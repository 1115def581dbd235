"""Real training steps for the tracker tests: the tiny random Qwen2 on a LocalBackend, a few fast GRPO steps.

``sft_then_grpo`` runs an SFT step and then GRPO steps at two learning rates: the config every tracker shows
must gain the GRPO section after the SFT one, and the new learning rate.

``train_twice`` trains a model with ``report_to``, ends its runs, then registers the same model again (a new
``TrainableModel`` and backend on the same folder, as after a restart) and trains once more: every tracker test
checks that the third step lands in the same run as the first two.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from art_core import LocalBackend, SFTConfig, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup

MESSAGES = [{"role": "user", "content": "Name a color."}]
REWARDS = [0.0, 1.0, 0.5, 0.25]
"""Per trajectory of every step: best is index 1, worst index 0; ``success`` is reward > 0.5."""


async def train_steps(model: TrainableModel, steps: int, *, learning_rate: float = 1e-3) -> list[dict[str, Any]]:
    """``steps`` GRPO steps, each on one group of four sampled replies with fixed rewards; the best trajectory
    carries a Langfuse trace id and link, as the Langfuse layer would leave them."""
    results = []
    for _ in range(steps):
        trajectories = await model.sample(MESSAGES, n=len(REWARDS), max_tokens=6, seed=model.step)
        for t, reward in zip(trajectories, REWARDS, strict=True):
            t.reward = reward
            t.metrics["success"] = float(reward > 0.5)
        trajectories[1].metadata["langfuse_trace_id"] = f"trace-{model.step + 1}"
        trajectories[1].metadata["langfuse_trace_url"] = f"http://langfuse.test/trace/trace-{model.step + 1}"
        results.append(await model.train([TrajectoryGroup(trajectories)], config=TrainConfig(learning_rate=learning_rate)))
    return results


async def train_twice(path: Path, base_model: Path, report_to: Callable[[], Any], *, name: str = "tracked",
                      project: str = "tracking", resumed_learning_rate: float = 1e-3) -> TrainableModel:
    """Two steps, finish, then a new model on the same folder resumes and trains a third (at
    ``resumed_learning_rate``). Returns the second."""
    for steps, learning_rate in ((2, 1e-3), (1, resumed_learning_rate)):
        model = TrainableModel(name=name, project=project, base_model=base_model, report_to=report_to())
        async with LocalBackend(path=path, serve=False, show_progress=False) as backend:
            await model.register(backend)
            await train_steps(model, steps, learning_rate=learning_rate)
            await model.finish_tracking()
    assert model.step == 3
    return model


SFT_MODEL = "sft-then-grpo"


async def sft_then_grpo(path: Path, base_model: Path, report_to: Callable[[], Any], *,
                        project: str = "tracking") -> TrainableModel:
    """Model ``SFT_MODEL``: step 1 SFT (``SFTConfig(learning_rate=5e-4)``), step 2 GRPO at learning rate 1e-3,
    step 3 GRPO at 2e-3; then its runs are finished."""
    model = TrainableModel(name=SFT_MODEL, project=project, base_model=base_model, report_to=report_to())
    async with LocalBackend(path=path, serve=False, show_progress=False) as backend:
        await model.register(backend)
        demonstration = Trajectory(messages=[*MESSAGES, {"role": "assistant", "content": "Blue."}])
        await model.train_sft([demonstration], config=SFTConfig(learning_rate=5e-4))
        await train_steps(model, 1, learning_rate=1e-3)
        await train_steps(model, 1, learning_rate=2e-3)
        await model.finish_tracking()
    assert model.step == 3
    return model
