"""MLflow: a real ``mlflow server`` on 127.0.0.1; metrics, params and the trajectory table read back through
``MlflowClient``."""

from __future__ import annotations

import json

import pandas

from mlflow import MlflowClient

from art_core import LocalBackend, TrainableModel
from art_core.tracking import MLFLOW_CONFIG_TAG_PREFIX, TRAJECTORY_TABLES, MLflowTracker
from tracked_steps import SFT_MODEL, sft_then_grpo, train_steps, train_twice


async def test_metrics_params_and_table_reach_the_mlflow_server_and_a_resumed_model_continues_the_run(
        tiny_model_dir, tmp_path, mlflow_server):
    await train_twice(tmp_path, tiny_model_dir, lambda: MLflowTracker(tracking_uri=mlflow_server),
                      project="mlflow-test")

    run_id = json.loads((tmp_path / "mlflow-test" / "models" / "tracked" / "tracking" / "runs.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("mlflow-test")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]  # the resumed model continued the run
    run = runs[0]
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert run.data.params["lora.rank"] == "8"
    assert run.data.params["train.learning_rate"] == "0.001"
    assert run.data.params["base_model"].endswith(tiny_model_dir.name)

    rewards = client.get_metric_history(run_id, "train/reward_mean")
    assert [m.step for m in rewards] == [1, 2, 3]
    assert all(abs(m.value - 0.4375) < 1e-6 for m in rewards)
    for key in ("train/loss", "train/grad_norm", "train/kl", "train/trained_tokens", "time/step", "rollout/success_mean"):
        assert [m.step for m in client.get_metric_history(run_id, key)] == [1, 2, 3], key

    # One table per report, in log_table's "split" JSON layout.
    files = [a.path for a in client.list_artifacts(run_id, TRAJECTORY_TABLES)]
    assert len(files) == 3 and files == sorted(files)
    rows = [row for path in files
            for row in pandas.read_json(client.download_artifacts(run_id, path, str(tmp_path)),
                                        orient="split").to_dict("records")]
    assert [(r["step"], r["label"]) for r in rows] == [(s, label) for s in (1, 2, 3) for label in ("best", "worst")]
    best = rows[0]
    assert best["reward"] == 1.0 and best["trace_id"] == "trace-1"
    assert best["trace_url"] == "http://langfuse.test/trace/trace-1"
    assert best["messages"].startswith("user: Name a color.")


async def test_sft_then_grpo_logs_both_sections_and_a_changed_learning_rate_as_a_tag_also_after_a_resume(
        tiny_model_dir, tmp_path, mlflow_server):
    tracker = lambda: MLflowTracker(tracking_uri=mlflow_server)  # noqa: E731
    await sft_then_grpo(tmp_path, tiny_model_dir, tracker, project="mlflow-sft")
    client = MlflowClient(tracking_uri=mlflow_server)
    [run] = client.search_runs([client.get_experiment_by_name("mlflow-sft").experiment_id])
    params, tags = run.data.params, run.data.tags
    assert params["sft.learning_rate"] == "0.0005" and "sft.epochs" in params  # step 1
    assert params["train.learning_rate"] == "0.001" and "train.loss" in params  # step 2 added the GRPO section
    assert tags[MLFLOW_CONFIG_TAG_PREFIX + "train.learning_rate"] == "0.002"  # step 3 changed it: a param cannot
    assert not any(key.startswith(MLFLOW_CONFIG_TAG_PREFIX + "sft.") for key in tags)

    # A new process resumes the run with another learning rate: the tag follows, the first value stays.
    model = TrainableModel(name=SFT_MODEL, project="mlflow-sft", base_model=tiny_model_dir, report_to=tracker())
    async with LocalBackend(path=tmp_path, serve=False, show_progress=False) as backend:
        await model.register(backend)
        await train_steps(model, 1, learning_rate=3e-3)
        await model.finish_tracking()
    resumed = client.get_run(run.info.run_id)
    assert resumed.data.params["train.learning_rate"] == "0.001"
    assert resumed.data.tags[MLFLOW_CONFIG_TAG_PREFIX + "train.learning_rate"] == "0.003"


async def test_without_a_tracking_uri_the_store_is_in_the_models_folder_not_the_current_one(
        tiny_model_dir, tmp_path, monkeypatch):
    """No ``MLFLOW_TRACKING_URI`` and no server: MLflow's own default would write ``mlflow.db`` (and artifacts)
    into the current directory; the runs go under the model's tracking folder, as the other trackers' files do."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    await train_twice(tmp_path / "art", tiny_model_dir, lambda: "mlflow", project="mlflow-local")
    assert list(cwd.iterdir()) == []
    folder = tmp_path / "art" / "mlflow-local" / "models" / "tracked" / "tracking"
    run_id = json.loads((folder / "runs.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow' / 'mlflow.db'}")
    assert [m.step for m in client.get_metric_history(run_id, "train/reward_mean")] == [1, 2, 3]  # one run, resumed
    assert len(client.list_artifacts(run_id, TRAJECTORY_TABLES)) == 3
    assert (folder / "mlflow" / "artifacts").is_dir()
