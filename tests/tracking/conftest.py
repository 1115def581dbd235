"""A real MLflow tracking server for the tracking tests: ``mlflow server`` on 127.0.0.1 with a sqlite store."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of an ``mlflow server`` (sqlite backend store, local artifact store served by the server)."""
    folder = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    mlflow = Path(sys.executable).with_name("mlflow")
    log = (folder / "server.log").open("wb")
    # Its own session: the server forks workers, and the group is what we stop (by our process's id).
    process = subprocess.Popen(
        [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}", "--artifacts-destination",
         str(folder / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "MLFLOW_ENABLE_WORKSPACES": "false"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180  # a readiness bound for a loaded machine, not a measured duration
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {process.returncode}: "
                                   f"{(folder / 'server.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not answer /health: {(folder / 'server.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()
