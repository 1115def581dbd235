"""Experiment tracking: a model's steps reported to W&B, MLflow, TensorBoard or Trackio, where the training loop
runs (so ``LocalBackend``, ``RemoteBackend`` and ``RayBackend`` report alike).

    model = TrainableModel(name="agent", report_to=["tensorboard", "mlflow"])
    ...
    await model.train(groups)          # metrics, the config (when new or changed) and the best/worst trajectories
    await model.finish_tracking()      # close the runs (the next step resumes them)

``report_to`` takes TRL's names (``"wandb"``, ``"mlflow"``, ``"tensorboard"``, ``"trackio"``), tracker objects
(``MLflowTracker(tracking_uri=...)``, or anything implementing ``Tracker``), or a list of them. Each tracker's
run id is kept in ``<model_dir>/tracking/runs.json``, so a model registered again continues the same runs.
Nothing here imports a tracker's library until the first step is reported.
"""

from ._base import RunInfo, ScoredRollout, StepReport, Tracker, TrajectoryRow
from ._mlflow import MLFLOW_CONFIG_TAG_PREFIX, MLFLOW_TRACE_ID_KEY, TRAJECTORY_TABLES, MLflowTracker
from ._report import TRACE_URL_KEY, step_report
from ._session import TRACKER_NAMES, ReportTo, TrackingSession, resolve_trackers
from ._tensorboard import TensorBoardTracker
from ._trackio import TrackioTracker
from ._wandb import WandbTracker

__all__ = [
    "MLFLOW_CONFIG_TAG_PREFIX",
    "MLFLOW_TRACE_ID_KEY",
    "MLflowTracker",
    "ReportTo",
    "RunInfo",
    "ScoredRollout",
    "StepReport",
    "TRACE_URL_KEY",
    "TRACKER_NAMES",
    "TRAJECTORY_TABLES",
    "TensorBoardTracker",
    "Tracker",
    "TrackingSession",
    "TrackioTracker",
    "TrajectoryRow",
    "WandbTracker",
    "resolve_trackers",
    "step_report",
]
