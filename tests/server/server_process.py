"""``art-core serve`` as a real second process on 127.0.0.1, for the server and RemoteBackend tests.

A module of its own (not conftest.py): tests import these helpers, and ``conftest`` names several files."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOKEN = "test-token-0123456789abcdef"


@dataclass
class Server:
    url: str
    path: Path
    process: subprocess.Popen[str]
    output: list[str] = field(default_factory=list)
    """Everything the server printed (stdout and stderr), for failure messages."""

    def log(self) -> str:
        return "".join(self.output[-80:])


def source_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with the worktree's packages first on the path (core/ and the repo root)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "core"), str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra or {})
    return env


@contextmanager
def running_server(path: Path, *, token: str | None = TOKEN, args: tuple[str, ...] = ()) -> Iterator[Server]:
    """Start `art-core serve --port 0` in a subprocess; yield once it prints its URL; stop it (SIGTERM) after."""
    command = [sys.executable, "-m", "art_core.cli", "serve", "--port", "0", "--path", str(path), "--threads", "1",
               *(["--token", token] if token else []), *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=source_env(), cwd=REPO)
    server = Server(url="", path=path, process=process)
    found = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            server.output.append(line)
            if line.startswith("ART_SERVER_URL="):
                server.url = line.split("=", 1)[1].strip()
                found.set()
        found.set()  # the process ended

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not found.wait(120) or not server.url:
            raise RuntimeError(f"the server did not start:\n{server.log()}")
        yield server
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        reader.join(5)
