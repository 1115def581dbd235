"""Write trajectories as a JSONL chat file, the format ``read_chat_file`` reads (OpenAI's fine-tuning format).

Each history of each trajectory (its main one, then ``additional_histories``) is one line:
``{"messages": [...], "tools": [...]}``. Token ids, rewards and metadata are not part of the format and are
left out; a trajectory's demonstrations written here and read back train the same way.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..errors import ConfigError
from ..types import Trajectory
from .chat_file import _check_line

__all__ = ["chat_problems", "write_chat_file"]


def write_chat_file(path: str | Path, trajectories: Iterable[Trajectory]) -> Path:
    """Write every history of ``trajectories`` to ``path``, one chat per line, atomically (temporary file + rename).

    Every line is checked as ``read_chat_file`` checks it before anything is written, so the file always reads
    back.

    Returns:
        The path written.

    Raises:
        ConfigError: a history would not read back (e.g. it holds no assistant turn); the message names the
            trajectory and the problem. Nothing is written then.
    """
    path = Path(path)
    lines = []
    for trajectory in trajectories:
        for number, line in enumerate(_chat_lines(trajectory)):
            problems = _check_line(line)
            if problems:
                raise ConfigError(f"trajectory {trajectory.id} (history {number}) cannot be written as a chat: "
                                  f"{'; '.join(problems)}")
            lines.append(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    tmp.replace(path)
    return path


def chat_problems(trajectories: Iterable[Trajectory]) -> list[str]:
    """What a chat file's checks find in ``trajectories`` (each history as the line it would be), one
    ``"trajectory <id> (history <k>): ..."`` string per problem: for SFT data given as trajectories without call
    records (written by hand, or a teacher's demonstrations), checked as strictly as the same data in a file."""
    return [f"trajectory {trajectory.id} (history {number}): {problem}"
            for trajectory in trajectories for number, line in enumerate(_chat_lines(trajectory))
            for problem in _check_line(line)]


def _chat_lines(trajectory: Trajectory) -> Iterator[str]:
    """Each history of ``trajectory`` as a chat file line."""
    for history in trajectory.histories():
        example: dict[str, object] = {"messages": [m.model_dump(mode="json", exclude_none=True)
                                                   for m in history.messages]}
        if history.tools:
            example["tools"] = history.tools
        yield json.dumps(example, ensure_ascii=False)
