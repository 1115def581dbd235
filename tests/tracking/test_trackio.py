"""Trackio: the run's logs, config and tables read back from Trackio's local store with its own ``SQLiteStorage``;
its dashboard (``trackio show``) opened in a headless Chromium shows the run and its reward metric.

Trackio reads ``TRACKIO_DIR`` once, when it is first imported, so the run and the read-back happen in a child
process whose environment points it at this test's folder.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

_SCRIPT = textwrap.dedent("""
    import asyncio, json, sys
    from pathlib import Path
    from tracked_steps import sft_then_grpo, train_twice

    path, base = Path(sys.argv[1]), Path(sys.argv[2])
    asyncio.run(train_twice(path, base, lambda: "trackio"))

    from trackio.sqlite_storage import SQLiteStorage
    runs = SQLiteStorage.get_runs("tracking")
    out = {"runs": runs, "ids": json.loads((path / "tracking/models/tracked/tracking/runs.json").read_text()),
           "logs": SQLiteStorage.get_logs("tracking", runs[0]), "config": SQLiteStorage.get_run_config("tracking", runs[0])}

    # An SFT step, then GRPO at two learning rates, in a project of its own.
    asyncio.run(sft_then_grpo(path, base, lambda: "trackio", project="sft-then-grpo"))
    [sft_run] = SQLiteStorage.get_runs("sft-then-grpo")
    out["sft_config"] = SQLiteStorage.get_run_config("sft-then-grpo", sft_run)
    out["sft_steps"] = [row["step"] for row in SQLiteStorage.get_logs("sft-then-grpo", sft_run)]
    print(json.dumps(out, default=str))
""")


@pytest.fixture(scope="module")
def trackio_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A model trained twice (resumed) with report_to="trackio" in a child process; the store's folder and what
    Trackio's ``SQLiteStorage`` reads back from it."""
    tmp_path = tmp_path_factory.mktemp("trackio")
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "models"), str(tiny_model_dir)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path / "trackio", json.loads(done.stdout.strip().splitlines()[-1])


def test_logs_config_and_table_reach_trackios_store_and_a_resumed_model_continues_the_run(trackio_run):
    _, out = trackio_run
    assert out["runs"] == [out["ids"]["trackio"]]  # one run: the resumed model appended to it
    logs = out["logs"]
    assert [row["step"] for row in logs] == [1, 2, 3]
    assert all(abs(row["train/reward_mean"] - 0.4375) < 1e-6 for row in logs)
    for key in ("train/loss", "train/grad_norm", "train/kl", "time/step", "rollout/success_mean"):
        assert all(key in row for row in logs), key
    table = logs[0]["trajectories"]
    assert table["_type"] == "trackio.table"
    best, worst = table["_value"]
    assert (best["label"], best["reward"], best["trace_id"]) == ("best", 1.0, "trace-1")
    assert (worst["label"], worst["reward"]) == ("worst", 0.0)
    assert out["config"]["lora"]["rank"] == 8 and out["config"]["train"]["learning_rate"] == 1e-3


def test_sft_then_grpo_leaves_trackio_the_latest_config_with_both_sections_in_one_run(trackio_run):
    _, out = trackio_run
    assert out["sft_steps"] == [1, 2, 3]  # reopening the run for the new config kept it one run
    assert out["sft_config"]["sft"]["learning_rate"] == 5e-4
    assert out["sft_config"]["train"]["learning_rate"] == 2e-3


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.fixture
def dashboard(trackio_run: tuple[Path, dict], tmp_path: Path) -> Iterator[str]:
    """``trackio show`` serving the store on 127.0.0.1 (a child process, stopped by its id)."""
    store, _ = trackio_run
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = f"import trackio; trackio.show(project='tracking', open_browser=False, block_thread=True, server_port={port})"
    log = (tmp_path / "show.log").open("wb")
    process = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "TRACKIO_DIR": str(store)},
                               stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/?project=tracking"
    try:
        deadline = time.monotonic() + 120  # a readiness bound for a loaded machine, not a measured duration
        while True:
            try:
                httpx.get(url, timeout=5)
                break
            except httpx.TransportError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"trackio show did not serve: {(tmp_path / 'show.log').read_text()[-2000:]}")
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here: apt-get install chromium")
def test_trackios_dashboard_shows_the_run_and_its_reward_metric(trackio_run, dashboard, tmp_path):
    _, out = trackio_run
    done = subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=30000", "--dump-dom",
                           dashboard], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    page = done.stdout
    assert out["ids"]["trackio"] in page  # the run
    assert "train/reward_mean" in page
