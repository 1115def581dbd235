"""The README's "Experiment tracking" example runs as written (the tiny model as its base), reporting to
TensorBoard files and a real MLflow server."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

from mlflow import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

README = Path(__file__).parents[2] / "README.md"


def _example() -> str:
    section = README.read_text(encoding="utf-8").split("## Experiment tracking", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


async def test_the_readmes_tracking_example_reports_to_tensorboard_and_mlflow(tiny_model_dir, tmp_path, monkeypatch,
                                                                              mlflow_server):
    code = _example()
    assert 'TrainableModel(name="colors", ' in code
    code = code.replace('TrainableModel(name="colors", ', f'TrainableModel(name="colors", base_model={str(tiny_model_dir)!r}, ')
    monkeypatch.chdir(tmp_path)  # LocalBackend() writes to ./.art
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    await asyncio.to_thread(exec, compile(code, "README.md", "exec"), {"__name__": "readme"})  # asyncio.run inside

    model_dir = tmp_path / ".art" / "default" / "models" / "colors"
    steps = sorted({json.loads(line)["step"] for line in (model_dir / "history.jsonl").read_text().splitlines()})
    (run_dir,) = (model_dir / "tracking" / "tensorboard").iterdir()
    accumulator = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    accumulator.Reload()
    assert sorted({e.step for e in accumulator.Tensors("train/reward_mean")}) == steps

    client = MlflowClient(tracking_uri=mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("default").experiment_id],
                                filter_string="attributes.run_name = 'colors'")
    assert run.info.run_id == json.loads((model_dir / "tracking" / "runs.json").read_text())["mlflow"]
    assert len(client.get_metric_history(run.info.run_id, "train/reward_mean")) == 3
    assert "rollout/success_mean" in run.data.metrics
