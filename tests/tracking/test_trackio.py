"""Trackio: the run's logs, config and tables read back from Trackio's local store with its own ``SQLiteStorage``.

Trackio reads ``TRACKIO_DIR`` once, when it is first imported, so the run and the read-back happen in a child
process whose environment points it at this test's folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

_SCRIPT = textwrap.dedent("""
    import asyncio, json, sys
    from pathlib import Path
    from tracked_steps import train_twice

    path, base = Path(sys.argv[1]), Path(sys.argv[2])
    asyncio.run(train_twice(path, base, lambda: "trackio"))

    from trackio.sqlite_storage import SQLiteStorage
    runs = SQLiteStorage.get_runs("tracking")
    out = {"runs": runs, "ids": json.loads((path / "tracking/models/tracked/tracking/runs.json").read_text()),
           "logs": SQLiteStorage.get_logs("tracking", runs[0]), "config": SQLiteStorage.get_run_config("tracking", runs[0])}
    print(json.dumps(out, default=str))
""")


def test_logs_config_and_table_reach_trackios_store_and_a_resumed_model_continues_the_run(tiny_model_dir, tmp_path):
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "models"), str(tiny_model_dir)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])

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
