"""MLflow traces of rollouts: every rollout an MLflow trace, every reward its feedback, every step its run.

    from art_plugins.mlflow import MLflowTracing

    model = TrainableModel(name="agent", report_to="mlflow")      # the run: metrics, params, table
    with MLflowTracing().tracing():                               # the rollouts an adapter runs in here
        for step in range(model.step, 10):
            groups = [await agent.group(task, n=8, reward=reward) for task in tasks]
            await model.train(groups)     # rewards attached to the traces as feedback, traces linked to the run

Each rollout of ``art_plugins.langgraph`` / ``art_plugins.openai_agents`` inside ``tracing()`` becomes one trace in
the experiment named after the model's project: the run's input, one ``LLM`` span per call the gateway answered
(request id, checkpoint step, prompt and completion tokens), tagged with the rollout and trajectory ids and the
checkpoint it sampled from. The trajectory carries the trace id (``metadata["mlflow_trace_id"]``); when the
model trains on it with ``report_to="mlflow"``, the step attaches its reward (and numeric metrics) to the trace as
feedback (``mlflow.log_feedback``) and links the trace to the model's MLflow run.

Traces and feedback go to the process's MLflow tracking URI (``MLFLOW_TRACKING_URI``), as MLflow's own tracing
does; this module changes no MLflow setting. As with any tracer (``art_plugins._tracing``), an Agents SDK run
traced here runs with the SDK's tracing on, so the SDK's own exporter sees it too (it sends to OpenAI only with
an OpenAI key set; ``agents.set_tracing_disabled`` or ``set_trace_processors`` control it). Feedback reaches a
trace only when a step trains on its trajectory (a held-out rollout keeps its trace, without feedback). Like every tracer, it never fails a rollout: its failures are counted
(``failures``) and logged.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from art_core.tracking import MLFLOW_TRACE_ID_KEY

from ._tracing import RolloutInfo, RoutedCall, tracing_rollouts

__all__ = ["MLflowTracing"]

logger = logging.getLogger(__name__)


class MLflowTracing:
    """A tracer (``art_plugins._tracing.Tracer``) that makes each rollout an MLflow trace.

    Args:
        experiment: the experiment the traces go to; default: the model's project (where ``report_to="mlflow"``
            puts the model's run).

    Raises:
        ConfigError: MLflow is not installed (``pip install 'art-core[mlflow]'``).
    """

    def __init__(self, *, experiment: str | None = None) -> None:
        from art_core.errors import ConfigError

        try:
            from mlflow import MlflowClient
        except ImportError as exc:
            raise ConfigError("MLflowTracing needs MLflow: pip install 'art-core[mlflow]'") from exc
        self.experiment = experiment
        self.failures = 0
        """Tracing calls that failed (each also logged)."""
        self._client = MlflowClient()
        self._experiments: dict[str, str] = {}
        self._lock = threading.Lock()

    @contextmanager
    def tracing(self) -> Iterator[MLflowTracing]:
        """Trace every rollout the adapters run in the code inside (and the tasks it starts)."""
        with tracing_rollouts(self):
            yield self

    def start_rollout(self, info: RolloutInfo) -> _RolloutTrace:
        """The observer of one rollout: starts its trace now (in memory; MLflow exports it when it ends)."""
        return _RolloutTrace(self, info)

    def experiment_id(self, name: str) -> str:
        """The id of the experiment ``name``, made when missing (asked once per name)."""
        with self._lock:
            if name not in self._experiments:
                found = self._client.get_experiment_by_name(name)
                self._experiments[name] = found.experiment_id if found is not None else \
                    self._client.create_experiment(name)
            return self._experiments[name]

    def note_failure(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        logger.warning("MLflow tracing: %s failed (%d so far): %s: %s", what, self.failures, type(exc).__name__, exc)


class _RolloutTrace:
    """One rollout's trace. Never raises: each MLflow call's failure is counted on the tracing."""

    def __init__(self, tracing: MLflowTracing, info: RolloutInfo) -> None:
        self.tracing = tracing
        self.info = info
        self.trace_id: str | None = None
        self._root: Any = None
        self._ended = False
        self._error: BaseException | None = None
        try:
            model = info.model
            experiment_id = tracing.experiment_id(tracing.experiment or model.project)
            # MlflowClient.start_trace sets no current span: concurrent rollouts each keep their own trace.
            self._root = tracing._client.start_trace(
                name=f"{info.framework} rollout", span_type="AGENT", inputs=_plain(info.input),
                experiment_id=experiment_id,
                tags={"art.model": model.name, "art.project": model.project, "art.rollout_id": info.rollout_id,
                      "art.trajectory_id": info.trajectory_id, "art.sampled_step": str(model.step),
                      **({"art.group_id": info.group_id} if info.group_id else {})})
            self.trace_id = self._root.trace_id
        except Exception as exc:
            tracing.note_failure("start_trace", exc)

    def enter(self) -> None:
        pass  # no current span to set: the client API keeps the trace apart from any context

    def exit(self, error: BaseException | None) -> None:
        self._error = error

    def langchain_callbacks(self) -> list[Any]:
        return []

    def on_call(self, call: RoutedCall) -> None:
        if self.trace_id is None or self._ended:
            return
        try:
            span = self.tracing._client.start_span(
                name="llm call", trace_id=self.trace_id, parent_id=self._root.span_id, span_type="LLM",
                attributes={"request_id": call.request_id, "adapter_step": call.adapter_step,
                            "prompt_tokens": call.prompt_tokens})
        except Exception as exc:
            self.tracing.note_failure("start_span", exc)
            return

        def done(completion_tokens: int | None) -> None:
            try:
                self.tracing._client.end_span(self.trace_id, span.span_id,
                                              attributes={"completion_tokens": completion_tokens})
            except Exception as exc:
                self.tracing.note_failure("end_span", exc)

        call.when_complete(done)  # a live stream's count comes when its body has been read

    def end(self) -> None:
        if self.trace_id is None or self._ended:
            return
        self._ended = True
        error = self._error
        try:
            self.tracing._client.end_trace(self.trace_id, status="ERROR" if error is not None else "OK",
                                           attributes={"error": f"{type(error).__name__}: {error}"} if error else None)
        except Exception as exc:
            self.tracing.note_failure("end_trace", exc)

    def link(self, trajectory: Any) -> None:
        if self.trace_id is not None:
            trajectory.metadata[MLFLOW_TRACE_ID_KEY] = self.trace_id

    def finish(self, trajectory: Any) -> None:
        pass  # the reward goes as feedback when the model trains on the trajectory (report_to="mlflow")


def _plain(value: Any) -> Any:
    """JSON-friendly (pydantic models dumped, the rest as text)."""
    try:
        return json.loads(json.dumps(value, default=lambda v: v.model_dump() if hasattr(v, "model_dump") else str(v)))
    except (TypeError, ValueError):
        return str(value)
