"""The MLflow UI, opened in a real headless Chromium, shows a test run's reward metric and a rollout trace with
its reward feedback.

Chromium renders the UI (a single-page app) and ``--dump-dom`` prints the page once it has settled:
``--virtual-time-budget`` lets the page's own timers and requests run to completion in virtual time, so the test
waits for the page, not for a wall-clock delay. Skipped where no Chromium is installed (``apt-get install
chromium``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from mlflow import MlflowClient
from tracked_steps import MESSAGES, REWARDS

from art_core import LocalBackend, TrainableModel, TrainConfig, TrajectoryGroup
from art_core.tracking import MLflowTracker
from art_plugins._tracing import RolloutInfo
from art_plugins.mlflow import MLflowTracing

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")

pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here: apt-get install chromium"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


def rendered(url: str, profile: Path) -> str:
    """The page's DOM as Chromium leaves it once the app has loaded its data."""
    done = subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           f"--user-data-dir={profile}", "--virtual-time-budget=30000", "--dump-dom", url],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


async def test_the_mlflow_ui_shows_the_reward_metric_and_a_rollout_trace_with_its_feedback(
        tiny_model_dir, tmp_path, monkeypatch, mlflow_server):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    model = TrainableModel(name="viewed", project="ui", base_model=tiny_model_dir,
                           report_to=MLflowTracker(tracking_uri=mlflow_server))
    tracing = MLflowTracing()
    async with LocalBackend(path=tmp_path / "art", serve=False, show_progress=False) as backend:
        await model.register(backend)
        trajectories = await model.sample(MESSAGES, n=len(REWARDS), max_tokens=6, seed=0)
        for trajectory, reward in zip(trajectories, REWARDS, strict=True):
            trajectory.reward = reward
        # The best rollout traced through the tracer interface, in the order an adapter's scope tells it.
        best = trajectories[1]
        observer = tracing.start_rollout(RolloutInfo(model=model, framework="langgraph", rollout_id="r-ui",
                                                     trajectory_id=best.id, input={"task": MESSAGES[0]["content"]},
                                                     group_id=None))
        observer.enter()
        observer.exit(None)
        observer.end()
        observer.link(best)
        observer.finish(best)
        # The step attaches the reward to the trace as feedback and links the trace to the run.
        await model.train([TrajectoryGroup(trajectories)], config=TrainConfig(learning_rate=1e-3))
        await model.finish_tracking()
    assert tracing.failures == 0 and model.tracking.failures == 0

    client = MlflowClient(tracking_uri=mlflow_server)
    experiment_id = client.get_experiment_by_name("ui").experiment_id
    run_id = json.loads((tmp_path / "art/ui/models/viewed/tracking/runs.json").read_text())["mlflow"]
    (trace,) = client.search_traces(locations=[experiment_id], run_id=run_id)

    run_page = rendered(f"{mlflow_server}/#/experiments/{experiment_id}/runs/{run_id}", tmp_path / "chromium")
    assert "viewed" in run_page and "train/reward_mean" in run_page
    traces_page = rendered(f"{mlflow_server}/#/experiments/{experiment_id}/traces", tmp_path / "chromium")
    assert trace.info.trace_id in traces_page
    assert "reward" in traces_page  # the feedback's column
