"""``report_to`` over ``RemoteBackend``: the step's metrics come back from the server and are reported where
the user's loop runs, as with ``LocalBackend``."""

from __future__ import annotations

from pathlib import Path

import pytest
from server_process import TOKEN, Server
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from art_core import CallRecord, RemoteBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
from art_core.tracking import TensorBoardTracker


def _group(step: int) -> TrajectoryGroup:
    prompt = list(range(100, 120))
    return TrajectoryGroup(
        Trajectory(calls=[CallRecord(prompt_token_ids=prompt, completion_token_ids=[200 + i + 10 * step, 2])],
                   reward=float(i), metrics={"success": float(i == 3)}) for i in range(4))


async def test_a_remote_models_steps_reach_its_trackers(server: Server, tiny_model_dir: Path, tmp_path: Path):
    log_dir = tmp_path / "tb"
    model = TrainableModel(name="tracked", project="remote-tracking", base_model=tiny_model_dir,
                           report_to=TensorBoardTracker(log_dir=log_dir))
    async with RemoteBackend(server.url, token=TOKEN, show_progress=False) as backend:
        await model.register(backend)
        for step in range(2):
            await model.train([_group(step)], config=TrainConfig(learning_rate=1e-3))
        await model.finish_tracking()
        history = await model.history()

    (run_dir,) = log_dir.iterdir()
    accumulator = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    accumulator.Reload()

    def values(tag: str) -> dict[int, float]:
        return {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in accumulator.Tensors(tag)}

    assert values("train/reward_mean") == {1: 1.5, 2: 1.5}  # mean of 0, 1, 2, 3
    # The server's own numbers (TensorBoard keeps float32)
    assert values("train/loss") == pytest.approx({row["step"]: row["loss"] for row in history}, rel=1e-6)
    assert values("rollout/success_mean") == {1: 0.25, 2: 0.25}
    assert set(values("time/step")) == {1, 2}
