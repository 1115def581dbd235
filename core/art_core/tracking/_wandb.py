"""Weights & Biases: one W&B run per model, resumed by id; set ``WANDB_MODE=offline`` to write files only."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from ._base import RunInfo, StepReport

__all__ = ["WandbTracker"]


class WandbTracker:
    """Logs to a W&B run (``wandb.init(id=..., resume="allow")``: a resumed model continues the same run).

    Args:
        project: the W&B project; default: the model's project.
        entity: the W&B team or user; default: W&B's (``WANDB_ENTITY`` or your default entity).
        mode: ``"online"``, ``"offline"`` or ``"disabled"``; default: W&B's (``WANDB_MODE``, else online).
        dir: where W&B writes its local files; default: ``<model_dir>/tracking`` (``wandb/`` inside it).
    """

    name = "wandb"

    def __init__(self, *, project: str | None = None, entity: str | None = None, mode: str | None = None,
                 dir: str | Path | None = None) -> None:
        self.project = project
        self.entity = entity
        self.mode = mode
        self.dir = Path(dir) if dir is not None else None
        self._run: Any = None

    def start(self, run: RunInfo) -> str:
        import wandb

        folder = self.dir or run.folder
        folder.mkdir(parents=True, exist_ok=True)
        # reinit="create_new": the model's run lives beside any run the user opened themselves.
        self._run = wandb.init(project=self.project or run.project, entity=self.entity, name=run.name,
                               id=run.run_id or uuid.uuid4().hex[:12], resume="allow", dir=str(folder),
                               mode=self.mode, reinit="create_new")
        # On resume the config may differ (a new learning rate): the latest is what the run shows.
        self._run.config.update(run.config, allow_val_change=True)
        return str(self._run.id)

    def log_step(self, report: StepReport) -> None:
        import wandb

        if report.config is not None:
            self._run.config.update(report.config, allow_val_change=True)
        data: dict[str, Any] = dict(report.metrics)
        if report.trajectories:
            rows = [row.as_dict() for row in report.trajectories]
            data["trajectories"] = wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])
        self._run.log(data, step=report.step)

    def finish(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
