"""Two machines, played by two processes on 127.0.0.1: `art-core serve` here, the agent in a virtualenv
without torch (scripts/setup_client_venv.sh, built once per machine).

The client runs a LangGraph group and an Agents SDK group through the server's gateway, trains step 1,
starts step 2 and is killed (SIGKILL) during it; a new client process sends step 2 again and gets its
result: step 2 is trained once, and its trajectories are on the server's disk.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_process import REPO, TOKEN, running_server

from art_core import read_groups_jsonl
from art_core.wire import API_PREFIX

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def client_python() -> str:
    """The client virtualenv's python: art-core[serve] and art-plugins[langgraph,openai-agents], no torch."""
    out = subprocess.run(["bash", str(REPO / "scripts" / "setup_client_venv.sh")], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def scripted_dir(smollm2_dir: Path) -> Path:
    sys.path.insert(0, str(HERE))
    from remote_agents import script
    from scripted_model import fit_scripted_model

    return fit_scripted_model(smollm2_dir, script())


def _client(python: str, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, ART_SERVER_TOKEN=TOKEN, OPENAI_AGENTS_DISABLE_TRACING="1", OPENAI_API_KEY="unused")
    # The worktree's code first (the venv holds a copy of it), the venv's own packages for everything else.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "core"), str(REPO), str(HERE), str(REPO / "tests")])
    return subprocess.Popen([python, str(HERE / "remote_client.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=HERE)


def test_client_without_torch(client_python: str, tmp_path: Path):
    out = subprocess.run([client_python, "-c", "import torch"], capture_output=True, text=True)
    assert out.returncode != 0 and "No module named 'torch'" in out.stderr
    # Commands that need the training stack say which extra to install, in one line, not a traceback.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "core"), str(REPO)]))
    for args in (["demo"], ["export", str(tmp_path / "model"), str(tmp_path / "out"), "--merged"]):
        out = subprocess.run([client_python, "-m", "art_core.cli", *args], capture_output=True, text=True, env=env)
        assert out.returncode == 1 and "pip install 'art-core[train]'" in out.stderr, out.stderr[-2000:]
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_agents_train_remotely_and_resume_after_a_crash(client_python: str, scripted_dir: Path, tmp_path: Path):
    groups_file = tmp_path / "step2-groups.jsonl"
    with running_server(tmp_path / "server") as server:
        args = (server.url, str(scripted_dir), str(groups_file))
        first = _client(client_python, "first", *args)
        assert first.stdout is not None
        lines, accepted, killed_at = [], 0, None
        for line in first.stdout:
            lines.append(line)
            if line.startswith("ACCEPTED"):
                accepted += 1
                if accepted == 2:  # the server took step 2: kill the agent in the middle of it
                    first.send_signal(signal.SIGKILL)
                    killed_at = time.monotonic()
                    break
        first.wait(30)
        log = "".join(lines)
        assert killed_at is not None, f"the client never reached step 2:\n{log}\n{server.log()}"
        headers = {"Authorization": f"Bearer {TOKEN}"}
        history_url = f"{server.url}{API_PREFIX}/models/remote/agent/history"
        # Step 2 was still training when the client died.
        assert [row["step"] for row in httpx.get(history_url, headers=headers).json()] == [1], log

        groups = {name: json.loads(rest) for name, rest in
                  (line.split(" ", 2)[1:] for line in lines if line.startswith("GROUP "))}
        assert groups["langgraph"]["tools"] == ["add"] * 4 and groups["langgraph"]["calls"] == [3] * 4, log
        assert groups["openai-agents"]["tools"] == ["add_numbers"] * 4, log
        assert groups["openai-agents"]["calls"] == [2] * 4, log
        assert json.loads(next(line for line in lines if line.startswith("RESULT"))[7:]) == {"step": 1,
                                                                                          "trained": 1.0}

        second = _client(client_python, "resume", *args)
        out, _ = second.communicate(timeout=300)
        assert second.returncode == 0, f"{out}\n{server.log()}"
        assert "REGISTERED 1" in out or "REGISTERED 2" in out, out
        states = [line.split()[1] for line in out.splitlines() if line.startswith("ACCEPTED")]
        assert states in (["running"], ["done"]), out  # re-attached to the same call: not a new one
        assert json.loads(out.split("RESULT ", 1)[1].splitlines()[0]) == {"step": 2, "trained": 1.0}

        # Step 2 completed once: one history row, one checkpoint, one trajectories file, with the groups sent.
        model_dir = server.path / "remote" / "models" / "agent"
        assert [row["step"] for row in httpx.get(history_url, headers=headers).json()] == [1, 2]
        assert sorted(p.name for p in (model_dir / "checkpoints").iterdir()) == ["0001", "0002"]
        assert sorted(p.name for p in (model_dir / "trajectories").iterdir()) == ["0001.jsonl", "0002.jsonl"]
        on_disk = read_groups_jsonl(model_dir / "trajectories" / "0002.jsonl")
        sent = read_groups_jsonl(groups_file)
        assert [[t.id for t in g] for g in on_disk] == [[t.id for t in g] for g in sent]
        assert len(list((model_dir / "train_calls").iterdir())) == 2
        print(f"second client saw the call {states[0]}; killed after {time.monotonic() - killed_at:.1f} s")
