"""MLflow: one MLflow run per model in the experiment named after its project, written through ``MlflowClient``
(no active-run state is set in the process).

When the rollouts were traced in MLflow (``art_plugins.mlflow``: each trajectory's ``metadata["mlflow_trace_id"]``),
each step also attaches every such trajectory's reward (and its numeric metrics) to its trace as feedback, and
links the traces to the run: the step is where reward and run meet.
"""

from __future__ import annotations

import time
from typing import Any

from ._base import RunInfo, StepReport

__all__ = ["MLFLOW_TRACE_ID_KEY", "TRAJECTORY_TABLES", "MLflowTracker", "flat_params"]

MLFLOW_TRACE_ID_KEY = "mlflow_trace_id"
"""``Trajectory.metadata`` key of the MLflow trace of the rollout (set by ``art_plugins.mlflow``)."""

TRAJECTORY_TABLES = "trajectories"
"""The run's artifact folder of trajectory tables: ``step_NNNN_<ms>.json`` per report, each a table in the
"split" JSON layout ``MlflowClient.log_table`` writes (``{"columns": [...], "data": [[...], ...]}``;
``pandas.read_json(path, orient="split")`` reads it)."""

_PARAM_CHARS = 6000  # MLflow's limit on a param value


class MLflowTracker:
    """Logs to an MLflow run: metrics per step, the config as params (once, when the run is made), and each
    step's trajectory table as an artifact under ``trajectories/``.

    Args:
        tracking_uri: the tracking server (``http://127.0.0.1:5000``) or store; default: MLflow's
            (``MLFLOW_TRACKING_URI``, else its local default).
        experiment: the experiment's name; default: the model's project.
    """

    name = "mlflow"

    def __init__(self, *, tracking_uri: str | None = None, experiment: str | None = None) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self._client: Any = None
        self._run_id: str | None = None

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id once started."""
        return self._run_id

    def start(self, run: RunInfo) -> str:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self._client = client = MlflowClient(tracking_uri=self.tracking_uri)
        if run.run_id is not None:
            client.update_run(client.get_run(run.run_id).info.run_id, status="RUNNING")
            self._run_id = run.run_id
            return run.run_id
        name = self.experiment or run.project
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(name)
        created = client.create_run(experiment_id, run_name=run.name, tags={"art.model": run.name})
        self._run_id = created.info.run_id
        params = [Param(key, value) for key, value in flat_params(run.config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(self._run_id, params=params[i:i + 100])
        return self._run_id

    def log_step(self, report: StepReport) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, report.step) for key, value in report.metrics.items()]
        self._client.log_batch(self._run_id, metrics=metrics)
        if report.trajectories:
            rows = [row.as_dict() for row in report.trajectories]
            # One small file per report: a single upload. (log_table appends to one file: it downloads and
            # re-uploads the whole table every step, several round trips that grow with the run.)
            self._client.log_dict(self._run_id, {"columns": list(rows[0]), "data": [list(r.values()) for r in rows]},
                                  f"{TRAJECTORY_TABLES}/step_{report.step:04d}_{now}.json")
        traced = [r for r in report.rollouts if r.metadata.get(MLFLOW_TRACE_ID_KEY)]
        if traced:
            self._attach_rewards(traced)

    def _attach_rewards(self, traced: list[Any]) -> None:
        import mlflow
        from mlflow.entities import AssessmentSource

        # Traces are exported in the background: the step's must be on the server before feedback names them.
        mlflow.flush_trace_async_logging()
        source = AssessmentSource(source_type="CODE", source_id="art.reward")
        trace_ids = []
        for rollout in traced:
            trace_id = str(rollout.metadata[MLFLOW_TRACE_ID_KEY])
            trace_ids.append(trace_id)
            mlflow.log_feedback(trace_id=trace_id, name="reward", value=rollout.reward, source=source)
            for key, value in rollout.metrics.items():
                mlflow.log_feedback(trace_id=trace_id, name=key, value=value, source=source)
        for i in range(0, len(trace_ids), 100):  # the server links at most 100 traces per call
            self._client.link_traces_to_run(trace_ids[i:i + 100], self._run_id)

    def finish(self) -> None:
        if self._client is not None and self._run_id is not None:
            self._client.set_terminated(self._run_id)


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"lora": {"rank": 8}}`` -> ``{"lora.rank": "8"}`` (MLflow params are flat strings)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:_PARAM_CHARS]
    return out
