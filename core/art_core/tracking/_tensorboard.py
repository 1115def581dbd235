"""TensorBoard: event files under ``<model_dir>/tracking/tensorboard/<run>``, written with TensorBoard's own
writer (no torch, no TensorFlow); a resumed model adds event files to the same run folder."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ._base import RunInfo, StepReport

__all__ = ["TensorBoardTracker"]


class TensorBoardTracker:
    """Writes scalars per step, the config (text ``config``: at step 0, again at a step that changed it, and at
    a resumed run's first step) and the trajectory table (text ``trajectories``).

    Args:
        log_dir: the folder ``tensorboard --logdir`` is pointed at; default ``<model_dir>/tracking/tensorboard``.
    """

    name = "tensorboard"

    def __init__(self, *, log_dir: str | Path | None = None) -> None:
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self._writer: Any = None
        self._resumed_config: dict[str, Any] | None = None  # written at a resumed run's first step
        self.run_dir: Path | None = None
        """The run's own folder, once started (``<log_dir>/<run id>``)."""

    def start(self, run: RunInfo) -> str:
        from tensorboard.plugins.text.summary_v2 import text_pb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        run_id = run.run_id or f"{run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.run_dir = (self.log_dir or run.folder / "tensorboard") / run_id
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(self.run_dir))
        if run.run_id is None:
            self._write(0, text_pb("config", _json_block(run.config)))
        else:  # a setting may have changed since the run was left; its first step here records the config
            self._resumed_config = run.config
        return run_id

    def log_step(self, report: StepReport) -> None:
        from tensorboard.plugins.scalar.summary_v2 import scalar_pb
        from tensorboard.plugins.text.summary_v2 import text_pb

        config, self._resumed_config = report.config or self._resumed_config, None
        if config is not None:  # the text plugin shows each step's entry: the config as of that step
            self._write(report.step, text_pb("config", _json_block(config)))
        for key, value in report.metrics.items():
            self._write(report.step, scalar_pb(key, value))
        if report.trajectories:
            self._write(report.step, text_pb("trajectories", _markdown_table([r.as_dict() for r in report.trajectories])))
        self._writer.flush()

    def finish(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _write(self, step: int, summary: Any) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))


def _json_block(config: dict[str, Any]) -> str:
    return "```json\n" + json.dumps(config, indent=2, default=str) + "\n```"


def _markdown_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table (TensorBoard's text plugin renders it); cells on one line, pipes escaped."""
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(r[k]) for k in header) + " |" for r in rows]
    return "\n".join(lines)
