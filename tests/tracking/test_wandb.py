"""W&B in offline mode: the run's history, config and trajectory tables read back from the files W&B wrote."""

from __future__ import annotations

import json

import wandb

from tracked_steps import SFT_MODEL, sft_then_grpo, train_twice
from wandb_files import config, history, run_ids

from art_core.tracking import WandbTracker


async def test_history_config_and_table_reach_wandb_files_and_a_resumed_model_continues_the_run(
        tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    await train_twice(tmp_path, tiny_model_dir, lambda: WandbTracker(mode="offline"))
    # run.finish() returns once W&B's service has the run's last records; its writer may still be closing the
    # file. teardown() stops the service, which closes every file: then the files are whole.
    wandb.teardown()

    folder = tmp_path / "tracking" / "models" / "tracked" / "tracking"
    run_id = json.loads((folder / "runs.json").read_text())["wandb"]
    files = sorted((folder / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2  # one per process session; `wandb sync` merges them into the one run
    assert {i for f in files for i in run_ids(f)} == {run_id}
    assert all(f.name == f"run-{run_id}.wandb" for f in files)

    rows = [row for f in files for row in history(f)]
    assert [row["_step"] for row in rows] == [1, 2, 3]
    assert all(abs(row["train/reward_mean"] - 0.4375) < 1e-6 for row in rows)
    for key in ("train/loss", "train/grad_norm", "train/kl", "train/trained_tokens", "time/step",
                "rollout/success_mean", "tracking/failures"):
        assert all(key in row for row in rows), key
    table = rows[0]["trajectories"]
    assert table["_type"] == "table-file" and table["nrows"] == 2
    table_file = files[0].parent / "files" / table["path"]
    written = json.loads(table_file.read_text())
    assert written["columns"][:5] == ["step", "label", "group", "trajectory_id", "reward"]
    best = dict(zip(written["columns"], written["data"][0], strict=True))
    assert (best["label"], best["reward"], best["trace_id"]) == ("best", 1.0, "trace-1")

    first = config(files[0])
    assert first["lora"]["rank"] == 8 and first["train"]["learning_rate"] == 1e-3


async def test_sft_then_grpo_updates_the_wandb_config_with_the_grpo_section_and_the_new_learning_rate(
        tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    await sft_then_grpo(tmp_path, tiny_model_dir, lambda: WandbTracker(mode="offline"))
    wandb.teardown()  # closes the run's file (see above)

    folder = tmp_path / "tracking" / "models" / SFT_MODEL / "tracking"
    [file] = (folder / "wandb").glob("offline-run-*/run-*.wandb")
    latest = config(file)
    assert latest["sft"]["learning_rate"] == 5e-4
    assert latest["train"]["learning_rate"] == 2e-3  # step 3's, after step 2's 1e-3
    assert "loss" in latest["train"] and "epochs" in latest["sft"]
