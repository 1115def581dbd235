"""MLflow: one MLflow run per model in the experiment named after its project, written through ``MlflowClient``
(no active-run state is set in the process).

When the rollouts were traced in MLflow (``art_plugins.mlflow``: each trajectory's ``metadata["mlflow_trace_id"]``),
each step also attaches every such trajectory's reward (and its numeric metrics) to its trace as feedback, and
links the traces to the run: the step is where reward and run meet.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ._base import RunInfo, StepReport

__all__ = ["MLFLOW_CONFIG_TAG_PREFIX", "MLFLOW_TRACE_ID_KEY", "TRAJECTORY_TABLES", "MLflowTracker", "flat_params"]

MLFLOW_TRACE_ID_KEY = "mlflow_trace_id"
"""``Trajectory.metadata`` key of the MLflow trace of the rollout (set by ``art_plugins.mlflow``)."""

TRAJECTORY_TABLES = "trajectories"
"""The run's artifact folder of trajectory tables: ``step_NNNN_<ms>.json`` per report, each a table in the
"split" JSON layout ``MlflowClient.log_table`` writes (``{"columns": [...], "data": [[...], ...]}``;
``pandas.read_json(path, orient="split")`` reads it)."""

MLFLOW_CONFIG_TAG_PREFIX = "config."
"""Tag prefix of a config value that changed after the run first logged it (``config.train.learning_rate``)."""

_PARAM_CHARS = 6000  # MLflow's limit on a param value
_TAG_CHARS = 8000  # and on a tag's


class MLflowTracker:
    """Logs to an MLflow run: metrics per step, the config as params (a value that changes later, as the tag
    ``config.<key>``), and each step's trajectory table as an artifact under ``trajectories/``.

    Args:
        tracking_uri: the tracking server (``http://127.0.0.1:5000``) or store; default:
            ``MLFLOW_TRACKING_URI``, else a local store in the model's tracking folder
            (``<model_dir>/tracking/mlflow/mlflow.db``, artifacts beside it; ``mlflow ui --backend-store-uri
            sqlite:///<that file>`` shows it), not MLflow's own default in the current directory.
        experiment: the experiment's name; default: the model's project.
    """

    name = "mlflow"

    def __init__(self, *, tracking_uri: str | None = None, experiment: str | None = None) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self._client: Any = None
        self._run_id: str | None = None
        self._config: dict[str, str] = {}  # the run's config as logged: flat key -> latest value

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id once started."""
        return self._run_id

    def start(self, run: RunInfo) -> str:
        from mlflow import MlflowClient

        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        local = None if uri else run.folder / "mlflow"
        if local is not None:  # files under the model's folder, as the other trackers' are
            local.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{(local / 'mlflow.db').resolve()}"
        self._client = client = MlflowClient(tracking_uri=uri)
        if run.run_id is not None:
            resumed = client.get_run(run.run_id)
            client.update_run(resumed.info.run_id, status="RUNNING")
            self._run_id = run.run_id
            self._config = _logged_config(resumed.data.params, resumed.data.tags)
        else:
            name = self.experiment or run.project
            experiment = client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(
                name, artifact_location=(local / "artifacts").resolve().as_uri() if local is not None else None)
            created = client.create_run(experiment_id, run_name=run.name, tags={"art.model": run.name})
            self._run_id = created.info.run_id
            self._config = {}
        self._log_config(run.config)  # a resumed run gets what changed (a new learning rate)
        return self._run_id

    def _log_config(self, config: dict[str, Any]) -> None:
        """Keys the run has not seen become params. A changed value becomes the tag ``config.<key>``: MLflow
        refuses to change a param, and the tag shows the latest value beside the first."""
        from mlflow.entities import Param, RunTag

        flat = flat_params(config)
        params = [Param(key, value) for key, value in flat.items() if key not in self._config]
        tags = [RunTag(MLFLOW_CONFIG_TAG_PREFIX + key, value[:_TAG_CHARS]) for key, value in flat.items()
                if key in self._config and self._config[key] != value]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params (or tags) per batch
            self._client.log_batch(self._run_id, params=params[i:i + 100])
        for i in range(0, len(tags), 100):
            self._client.log_batch(self._run_id, tags=tags[i:i + 100])
        self._config.update(flat)

    def log_step(self, report: StepReport) -> None:
        from mlflow.entities import Metric

        if report.config is not None:
            self._log_config(report.config)
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


def _logged_config(params: dict[str, str], tags: dict[str, str]) -> dict[str, str]:
    """A resumed run's config as logged: its params, each overridden by a later ``config.<key>`` tag."""
    changed = {key.removeprefix(MLFLOW_CONFIG_TAG_PREFIX): value for key, value in tags.items()
               if key.startswith(MLFLOW_CONFIG_TAG_PREFIX)}
    return {**params, **changed}
