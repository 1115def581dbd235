"""The ``Tracker`` contract and the plain data a tracker receives: the run's identity, then one report per step.

A tracker is told, in order::

    run_id = tracker.start(run)       # first step of this process: open (or resume) the run, log its config
    tracker.log_step(report)          # after every ``model.train`` (metrics + a few trajectories; the config
                                      # again, in ``report.config``, when a step changed it)
    tracker.finish()                  # ``model.finish_tracking()``: close the run (the next step reopens it)

This module imports only the standard library: a tracker's own library is imported in its ``start``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = ["RunInfo", "ScoredRollout", "StepReport", "Tracker", "TrajectoryRow"]


@dataclass(frozen=True)
class RunInfo:
    """What a tracker needs to open its run."""

    project: str
    """The model's project: the W&B / Trackio project, the MLflow experiment."""
    name: str
    """The model's name: the run's display name."""
    run_id: str | None
    """The id this tracker returned for the model's run before (kept in ``<model_dir>/tracking/runs.json``): resume that run.
    None: start a new one."""
    folder: Path
    """A folder on this machine the tracker may write its local files under (``<model_dir>/tracking``)."""
    config: dict[str, Any]
    """The run's configuration: ``{"project", "model", "base_model", "lora": {...}, "train": {...}}``, with
    ``"train"`` the GRPO steps' ``TrainConfig`` and ``"sft"`` the SFT steps' ``SFTConfig`` (each once the model
    has run such a step)."""


@dataclass(frozen=True)
class TrajectoryRow:
    """One trajectory of a step's table (the best or the worst of the step)."""

    step: int
    label: str
    """``"best"`` or ``"worst"`` (by reward)."""
    group: int
    """Index of its group in the step's groups."""
    trajectory_id: str
    reward: float
    messages: str
    """The conversation as text, one ``role: content`` block per message (cut to a few thousand characters)."""
    trace_id: str | None
    """Its Langfuse trace id (``metadata["langfuse_trace_id"]``) when Langfuse traced the rollout."""
    trace_url: str | None
    """A link to that trace when the rollout's metadata carries one (``metadata["langfuse_trace_url"]``)."""

    def as_dict(self) -> dict[str, Any]:
        """The row as a plain dict (the column order of every tracker's table)."""
        return {"step": self.step, "label": self.label, "group": self.group, "trajectory_id": self.trajectory_id,
                "reward": self.reward, "messages": self.messages, "trace_id": self.trace_id or "",
                "trace_url": self.trace_url or ""}


@dataclass(frozen=True)
class ScoredRollout:
    """Every trajectory of a step, as a tracker that traced its rollout needs it (to attach the reward)."""

    trajectory_id: str
    reward: float
    metrics: dict[str, float]
    """The trajectory's finite numeric ``metrics``."""
    metadata: dict[str, Any]
    """The trajectory's ``metadata`` (a tracer's trace id is there, e.g. ``"mlflow_trace_id"``)."""


@dataclass(frozen=True)
class StepReport:
    """What one ``model.train`` call reports."""

    step: int
    """The model's step after the call (the x-axis); equal to the previous one when nothing was trained."""
    metrics: dict[str, float]
    """Finite numbers, namespaced: ``train/...`` (the backend's step metrics), ``rollout/...`` (means over the
    step's trajectories), ``time/...`` (seconds), ``tracking/failures``."""
    trajectories: list[TrajectoryRow] = field(default_factory=list)
    """The step's best and worst trajectories."""
    rollouts: list[ScoredRollout] = field(default_factory=list)
    """Every trajectory of the step: reward, metrics and metadata."""
    config: dict[str, Any] | None = None
    """The run's configuration (``RunInfo.config``'s layout) when it changed since the trackers last got it (an
    SFT step then GRPO steps adds a section, a new learning rate changes one); None when it did not. A tracker
    shows it as the run's latest config."""


@runtime_checkable
class Tracker(Protocol):
    """Somewhere a run's metrics go (W&B, MLflow, TensorBoard, Trackio, or your own).

    Example, a tracker that prints::

        class Printer:
            name = "printer"

            def start(self, run: RunInfo) -> str:
                return run.run_id or "printed"

            def log_step(self, report: StepReport) -> None:
                print(report.step, report.metrics["train/reward_mean"])

            def finish(self) -> None:
                pass

    Methods may raise: the model counts the failure and warns once per step; training goes on.
    """

    name: str
    """The key its run id is kept under in ``<model_dir>/tracking/runs.json`` (one tracker per name on a model)."""

    def start(self, run: RunInfo) -> str:
        """Open the run (resume ``run.run_id`` when given) and log ``run.config``.

        Returns:
            The run's id, kept so that the model resumes this run after a restart.
        """
        ...

    def log_step(self, report: StepReport) -> None:
        """Log one step's metrics and trajectory table."""
        ...

    def finish(self) -> None:
        """Close the run (flush files, mark it finished)."""
        ...
