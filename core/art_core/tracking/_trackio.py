"""Trackio: a local-first tracker (SQLite under ``TRACKIO_DIR``, default ``~/.cache/huggingface/trackio``)."""

from __future__ import annotations

import time
from typing import Any

from ._base import RunInfo, StepReport

__all__ = ["TrackioTracker"]


class TrackioTracker:
    """Logs to a Trackio run; Trackio keys runs by name, so the run id kept for resuming is the run's name.

    Args:
        project: the Trackio project; default: the model's project.
    """

    name = "trackio"

    def __init__(self, *, project: str | None = None) -> None:
        self.project = project
        self._run: Any = None
        self._run_name = ""
        self._project = ""

    def start(self, run: RunInfo) -> str:
        # A new run gets a new name: a model trained again from scratch must not append to an old run.
        self._run_name = run.run_id or f"{run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        self._project = self.project or run.project
        self._open(run.config)
        return self._run_name

    def _open(self, config: dict[str, Any]) -> None:
        import trackio

        # System metrics off: this is the training loop's process, and the tracker should cost it nothing.
        self._run = trackio.init(project=self._project, name=self._run_name, config=config, resume="allow",
                                 embed=False, auto_log_cpu=False, auto_log_gpu=False)

    def log_step(self, report: StepReport) -> None:
        import trackio

        if report.config is not None:
            # Trackio stores a run's config with the first log after init (replacing the stored one) and has no
            # call to update it later: reopening the run is the public way to send the new one.
            self._run.finish()
            self._open(report.config)
        data: dict[str, Any] = dict(report.metrics)
        if report.trajectories:
            rows = [row.as_dict() for row in report.trajectories]
            data["trajectories"] = trackio.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])
        self._run.log(data, step=report.step)

    def finish(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
