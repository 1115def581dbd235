"""Langfuse traces of a training run: ``LangfuseTracing`` (a tracer: scores, step traces, delivery) and
``RolloutTrace`` (its observer of one rollout). What goes where is in ``art_plugins.langfuse``'s docstring."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from art_core import TrainableModel, Trajectory, TrajectoryGroup
from art_core.errors import ConfigError
from art_core.types import TRACE_ID_KEY

from . import _langfuse_sdk as sdk
from ._langfuse_delivery import FailureCounter, bounded, failure_handlers, plain
from ._tracing import RolloutInfo, RoutedCall

try:
    from langfuse import Langfuse, LangfuseOtelSpanAttributes, propagate_attributes
    from opentelemetry import trace as otel_trace
    from opentelemetry.sdk.trace import TracerProvider
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("art_plugins.langfuse needs the Langfuse SDK: pip install 'art-plugins[langfuse]'") from exc

__all__ = ["ROLLOUT_TRACE_NAME", "STEP_TRACE_NAME", "LangfuseTracing", "RolloutTrace", "dataset_item",
           "reward_scores"]

logger = logging.getLogger("art_plugins.langfuse")  # the name users filter on, as before the split

ROLLOUT_TRACE_NAME = "rollout"
STEP_TRACE_NAME = "training-step"
_METADATA = LangfuseOtelSpanAttributes.OBSERVATION_METADATA
_USAGE_KEY = LangfuseOtelSpanAttributes.OBSERVATION_USAGE_DETAILS
_ROLLOUT_ID_KEY, _ADAPTER_STEP_KEY, _REQUEST_ID_KEY, _PROMPT_TOKENS_KEY, _TRAINABLE_KEY, _COMPLETION_TOKENS_KEY = (
    f"{_METADATA}.{key}" for key in ("rollout_id", "adapter_step", "request_id", "prompt_tokens", "trainable",
                                     "completion_tokens"))
_LLM_SPAN_MARKS = ((LangfuseOtelSpanAttributes.OBSERVATION_TYPE, "generation"),  # Langfuse's LangChain handler
                   ("openinference.span.kind", "LLM"))                            # OpenInference (Agents SDK)

dataset_item: ContextVar[Any] = ContextVar("art_plugins_langfuse_item", default=None)
"""The dataset item ``evaluate`` is running (its rollout joins the trace Langfuse's experiment runner opened)."""


class LangfuseTracing:
    """Sends a training run to Langfuse: rollouts as traces, rewards as scores, steps as traces.

    Args:
        client: a ``Langfuse`` client. Default: one built from ``LANGFUSE_PUBLIC_KEY``, ``LANGFUSE_SECRET_KEY``
            and ``LANGFUSE_BASE_URL`` (and the SDK's other ``LANGFUSE_*`` variables), with a tracer provider
            of its own so the process's global OpenTelemetry provider stays as it was (sampled at
            ``LANGFUSE_SAMPLE_RATE``, as the SDK's own would be). ``aclose()`` flushes it, never shuts it down.
        session_id: the Langfuse session every trace joins. Default: ``"<project>/<model name>"``, one session
            per training run.
        flush_timeout: seconds a step (or an evaluation) waits for spans and scores to leave; what is still
            queued then goes on in the background.
        print_links: print the best and worst trajectory's trace URLs at the end of each step.

    Raises:
        ConfigError: no client was given and the environment lacks the keys.
    """

    def __init__(self, client: Langfuse | None = None, *, session_id: str | None = None, flush_timeout: float = 5.0,
                 print_links: bool = True) -> None:
        if flush_timeout <= 0:
            raise ConfigError(f"flush_timeout is {flush_timeout}: give a positive number of seconds")
        if client is None:
            missing = [k for k in ("LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY") if not os.environ.get(k)]
            if missing:
                verb = "is" if len(missing) == 1 else "are"
                raise ConfigError(f"langfuse=True reads the Langfuse keys from the environment, but "
                                  f"{' and '.join(missing)} {verb} not set: set LANGFUSE_PUBLIC_KEY, "
                                  "LANGFUSE_SECRET_KEY (and LANGFUSE_BASE_URL for a server other than Langfuse "
                                  "Cloud), or pass langfuse=Langfuse(...)")
            # Our own provider: Langfuse would otherwise install its provider as the process's global one.
            client = Langfuse(tracer_provider=TracerProvider(shutdown_on_exit=False, sampler=_env_sampler()))
        elif not isinstance(client, Langfuse):
            raise ConfigError(f"langfuse= takes True, a langfuse.Langfuse client or a LangfuseTracing, got "
                              f"{type(client).__name__}")
        self.client = client
        self.session_id = session_id
        self.flush_timeout = flush_timeout
        self.print_links = print_links
        # The LangChain handler finds the client by public key; OpenInference exports through the provider.
        self.public_key: str | None = sdk.client_public_key(client)
        self.tracer_provider: Any = sdk.client_tracer_provider(client) or otel_trace.get_tracer_provider()
        self.failures = FailureCounter()
        self._reported = 0
        self._flushing: asyncio.Future[Any] | None = None
        self._detach: dict[int, Callable[[], None]] = {}  # id(model) -> removes the step hook
        self._trace_ids: set[str] = set()  # rollout traces made here, not yet reported by a step
        self._handler_type: type | None = None  # LangGraph rollouts' LangChain handler class, imported when used
        self._closed = False
        failure_handlers.acquire(self.failures)

    def __repr__(self) -> str:
        return f"LangfuseTracing(public_key={self.public_key!r}, session_id={self.session_id!r})"

    @property
    def closed(self) -> bool:
        """Whether ``aclose()`` was called."""
        return self._closed

    # -- wiring -----------------------------------------------------------------------------------------

    def attach(self, model: TrainableModel) -> None:
        """Trace ``model``'s training steps (once per model, however many adapters share it)."""
        if id(model) not in self._detach:
            self._detach[id(model)] = model.add_step_hook(self.on_step)

    def session_for(self, model: TrainableModel) -> str:
        """The Langfuse session id of ``model``'s traces: ``session_id``, else ``"<project>/<model name>"``."""
        return self.session_id or f"{model.project}/{model.name}"

    def start_rollout(self, info: RolloutInfo) -> RolloutTrace:
        """The trace of one rollout (the ``Tracer`` method a rollout scope calls); see ``RolloutTrace``."""
        if info.framework == "openai-agents":
            _instrument_agents_sdk(self.tracer_provider)
        return RolloutTrace(self, info)

    def langchain_handler_type(self) -> type:
        """The LangChain handler class of LangGraph rollouts (``_langfuse_langchain.LightStateHandler``)."""
        if self._handler_type is None:
            from ._langfuse_langchain import LightStateHandler

            self._handler_type = LightStateHandler
        return self._handler_type

    # -- scores -----------------------------------------------------------------------------------------

    def send_scores(self, trajectory: Trajectory) -> None:
        """The trajectory's reward and reward components as scores on its trace (replacing earlier ones)."""
        trace_id = trajectory.metadata.get(TRACE_ID_KEY)
        if not isinstance(trace_id, str):
            return
        for name, value, comment in reward_scores(trajectory):
            try:
                # A fixed id per (trace, name): sending again (after RULER, at the step) updates the score.
                self.client.create_score(name=name, value=value, trace_id=trace_id, comment=comment,
                                         score_id=f"{trace_id}-{name}", data_type="NUMERIC")
            except Exception as exc:  # the SDK only queues; never let a score fail the run
                self.failures.note(f"score {name!r}: {exc}")

    # -- steps ------------------------------------------------------------------------------------------

    async def on_step(self, model: TrainableModel, groups: list[TrajectoryGroup], metrics: dict[str, Any]) -> None:
        """The step hook: final scores, the step's trace, bounded flush, failure report, best/worst links."""
        # Only the trajectories traced here: another LangfuseTracing (another project) reports its own.
        trajectories = [t for g in groups for t in g.trajectories if t.metadata.get(TRACE_ID_KEY) in self._trace_ids]
        if not trajectories:
            return
        self._trace_ids.difference_update(str(t.metadata[TRACE_ID_KEY]) for t in trajectories)
        for trajectory in trajectories:
            self.send_scores(trajectory)
        trace_ids = [str(t.metadata[TRACE_ID_KEY]) for t in trajectories]
        step_trace_id = None
        try:
            step_trace_id = self._step_trace(model, groups, metrics, trace_ids)
        except Exception as exc:
            self.failures.note(f"step trace: {exc}")
        links = await self._links(step_trace_id, trajectories) if self.print_links else []
        if not await self.flush():
            self.failures.note(f"flush did not finish within {self.flush_timeout} s")
        self._report(model.step)
        for line in links:
            print(line, flush=True)

    def _step_trace(self, model: TrainableModel, groups: list[TrajectoryGroup], metrics: dict[str, Any],
                    trace_ids: list[str]) -> str:
        trace_id = Langfuse.create_trace_id()
        rewards = [t.reward for g in groups for t in g.trajectories]
        labels = {"model": model.name, "step": str(model.step), "project": model.project}
        with propagate_attributes(session_id=self.session_for(model), trace_name=STEP_TRACE_NAME, metadata=labels):
            with self.client.start_as_current_observation(
                trace_context={"trace_id": trace_id}, name=STEP_TRACE_NAME, as_type="span",
                input={"groups": len(groups), "trajectories": len(rewards), "trajectory_trace_ids": trace_ids},
                metadata={"trajectory_trace_ids": trace_ids, "step": model.step},
            ) as span:
                span.update(output=plain(metrics))
        return trace_id

    async def _links(self, step_trace_id: str | None, trajectories: list[Trajectory]) -> list[str]:
        if not trajectories:
            return []
        best = max(trajectories, key=lambda t: t.reward)
        worst = min(trajectories, key=lambda t: t.reward)
        wanted = [("step", step_trace_id, None), ("best", best.metadata[TRACE_ID_KEY], best),
                  ("worst", worst.metadata[TRACE_ID_KEY], worst)]
        try:
            done, urls = await bounded(lambda: [self.client.get_trace_url(trace_id=str(tid)) if tid else None
                                                for _, tid, _ in wanted], self.flush_timeout)
        except Exception as exc:  # the project id is read from the server: it may be down
            done, urls = False, None
            self.failures.note(f"could not read the trace URLs (GET /api/public/projects): {exc}")
        if not done or urls is None:
            urls = [None, None, None]
        lines = []
        for (label, tid, trajectory), url in zip(wanted, urls, strict=True):
            if tid is None:
                continue
            where = url or f"trace {tid}"
            reward = f" reward {trajectory.reward:.3f}" if trajectory is not None else ""
            lines.append(f"Langfuse {label:>5}{reward}: {where}")
        return lines

    # -- delivery ---------------------------------------------------------------------------------------

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout``, default ``flush_timeout``) for queued spans and scores to be sent.

        Returns:
            Whether everything was sent in time; otherwise sending goes on in the background.
        """
        if self._flushing is not None and not self._flushing.done():
            return False  # the previous flush is still stuck on the network: do not pile up threads
        try:
            done, _ = await bounded(self.client.flush, timeout or self.flush_timeout, keep=self._keep_flush)
        except Exception as exc:
            self.failures.note(f"flush: {exc}")
            return False
        return done

    def _keep_flush(self, pending: asyncio.Future[Any]) -> None:
        self._flushing = pending

    def _report(self, step: int) -> None:
        count = self.failures.count - self._reported
        self._reported = self.failures.count
        if count:
            logger.warning("Langfuse: %d export failure(s) since the last report (step %d); last: %s. Training "
                           "goes on; traces or scores may be missing.", count, step, self.failures.last)

    def failure_report(self) -> tuple[int, str | None]:
        """``(failures counted so far, the last one's message)``."""
        return self.failures.count, self.failures.last

    async def aclose(self, timeout: float | None = None) -> None:
        """Flush (bounded), detach from the models and remove the failure counter.

        The client is never shut down, even one made here: the SDK shares one set of exporters among all the
        process's clients with the same public key, so shutting it would silence the caller's own client and
        every later ``LangfuseTracing`` (their scores dropped). The SDK's exit handler flushes at exit.
        """
        if self._closed:
            return
        self._closed = True
        try:
            await bounded(self.client.flush, timeout or self.flush_timeout)
        except Exception as exc:
            self.failures.note(f"flush: {exc}")
        failure_handlers.release(self.failures)
        for detach in self._detach.values():
            detach()
        self._detach.clear()


class RolloutTrace:
    """One rollout's Langfuse trace: a ``RolloutObserver`` (``art_plugins._tracing``) its scope tells what happens.

    While the scope is open, the rollout's root observation is the current OpenTelemetry span and trace-level
    attributes are propagated to every observation started in the run; each routed call's gateway facts are
    written onto the framework's LLM observation (see ``art_plugins.langfuse``).
    """

    def __init__(self, tracing: LangfuseTracing, info: RolloutInfo) -> None:
        self.tracing = tracing
        self.info = info
        self.item = dataset_item.get()
        # In a dataset run the trace is the one Langfuse's experiment runner opened for the item.
        self.trace_id = (tracing.client.get_current_trace_id() if self.item is not None else None) \
            or Langfuse.create_trace_id(seed=info.trajectory_id)
        self.root: Any = None
        self._rollout_id_json = json.dumps(info.rollout_id)
        self._stack = contextlib.ExitStack()

    # -- the run ----------------------------------------------------------------------------------------

    def enter(self) -> None:
        info, client = self.info, self.tracing.client
        # Trace attributes are not masked by the SDK (only observations' input, output and metadata are):
        # the task text, the user's words, goes through the client's mask here.
        task = sdk.masked(client, _task_text(info.input))
        labels = {"model": info.model.name, "step": str(info.model.step), "group": info.group_id or "",
                  "task": task if isinstance(task, str) else json.dumps(task, default=str)[:200],
                  "framework": info.framework, "rollout_id": info.rollout_id,
                  "trajectory_id": info.trajectory_id}
        try:
            self._stack.enter_context(propagate_attributes(
                session_id=self.tracing.session_for(info.model), metadata=labels,
                trace_name=None if self.item is not None else ROLLOUT_TRACE_NAME))
            # Ended by ``end()``: a streamed run goes on after its scope's ``with`` (its task copied the context).
            self.root = self._stack.enter_context(client.start_as_current_observation(
                trace_context=None if self.item is not None else {"trace_id": self.trace_id},
                name=ROLLOUT_TRACE_NAME, as_type="agent", input=plain(info.input), metadata=labels,
                end_on_exit=False))
        except Exception as exc:  # tracing must never stop the rollout
            self.tracing.failures.note(f"rollout trace: {exc}")

    def exit(self, error: BaseException | None) -> None:
        try:  # the error, if any, is recorded on the root observation as it leaves the context
            self._stack.__exit__(type(error) if error is not None else None, error,
                                 error.__traceback__ if error is not None else None)
        except Exception as exc:
            self.tracing.failures.note(f"rollout trace: {exc}")

    def end(self) -> None:
        root, self.root = self.root, None
        if root is not None:
            try:
                root.end()
            except Exception as exc:
                self.tracing.failures.note(f"rollout trace: {exc}")

    def langchain_callbacks(self) -> list[Any]:
        """Langfuse's LangChain ``CallbackHandler`` (the compact one), its runs nested under the rollout."""
        context = {"trace_id": self.trace_id}
        if self.root is not None:
            context["parent_span_id"] = self.root.id
        handler = self.tracing.langchain_handler_type()(public_key=self.tracing.public_key, trace_context=context)
        # Inline, LangChain calls it in the task making the LLM call, so its generation is the current span
        # while the request is sent and ``on_call`` can write the gateway's answer onto it.
        handler.run_inline = True
        return [handler]

    def on_call(self, call: RoutedCall) -> None:
        """Write what the gateway says about a routed call onto the observation making it."""
        try:
            prompt = call.prompt_tokens
            span = otel_trace.get_current_span()
            attributes = getattr(span, "attributes", None) or {}
            if span.is_recording() and any(attributes.get(k) == v for k, v in _LLM_SPAN_MARKS):
                # The attributes ``update(metadata=...)`` would write (each value JSON-encoded), set directly:
                # ints and the rollout id's JSON (encoded once per rollout) need no encoder.
                span.set_attributes({_ROLLOUT_ID_KEY: self._rollout_id_json,
                                     _ADAPTER_STEP_KEY: str(call.adapter_step),
                                     _REQUEST_ID_KEY: json.dumps(call.request_id), _PROMPT_TOKENS_KEY: str(prompt),
                                     _TRAINABLE_KEY: "true"})

                def write(count: int | None) -> None:
                    if count is None:
                        span.set_attribute(_USAGE_KEY, f'{{"input": {prompt}}}')
                    else:  # json.dumps(_usage(prompt, count)), written out
                        span.set_attributes({
                            _USAGE_KEY: f'{{"input": {prompt}, "output": {count}, "total": {prompt + count}}}',
                            _COMPLETION_TOKENS_KEY: str(count)})
            else:
                # No framework observation around the call (a client outside the instrumented frameworks):
                # record the call as a generation of its own under the rollout.
                facts = {"rollout_id": self.info.rollout_id, "adapter_step": call.adapter_step,
                         "request_id": call.request_id, "prompt_tokens": prompt, "trainable": True}
                parent = {"parent_span_id": self.root.id} if self.root else {}
                generation = self.tracing.client.start_observation(
                    trace_context={"trace_id": self.trace_id, **parent}, name="trainable-call", as_type="generation",
                    model=self.info.model.name, metadata=facts)

                def write(count: int | None) -> None:
                    generation.update(usage_details=_usage(prompt, count),
                                      metadata=None if count is None else {"completion_tokens": count})
                    generation.end()
            if call.completion_tokens is not None:
                write(call.completion_tokens)
            else:  # a live stream: the count comes when its body has been read (still inside the observation)
                call.when_complete(lambda count: self._written(write, count))
        except Exception as exc:
            self.tracing.failures.note(f"call observation: {exc}")

    def _written(self, write: Callable[[int | None], None], count: int | None) -> None:
        try:
            write(count)
        except Exception as exc:
            self.tracing.failures.note(f"call observation: {exc}")

    # -- the trajectory ---------------------------------------------------------------------------------

    def link(self, trajectory: Trajectory) -> Trajectory:
        """Store the trace id in ``trajectory.metadata["langfuse_trace_id"]`` (before scoring)."""
        trajectory.metadata[TRACE_ID_KEY] = self.trace_id
        if self.item is not None:
            trajectory.metadata["langfuse_dataset_item_id"] = getattr(self.item, "id", None)
        else:  # a training rollout: its step will report it
            self.tracing._trace_ids.add(self.trace_id)
        return trajectory

    def finish(self, trajectory: Trajectory) -> Trajectory:
        """After scoring: the reward scores on the trace (in a dataset run the experiment runner sends them)."""
        if self.item is None:
            self.tracing.send_scores(trajectory)
        return trajectory


def _env_sampler() -> Any:
    """The sampler the SDK gives its own provider: ``LANGFUSE_SAMPLE_RATE`` below 1 samples that share of traces
    by trace id (the SDK drops the scores of the traces left out alike). None: every trace. A value the SDK
    refuses is left for its own error."""
    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    try:
        rate = float(os.environ.get("LANGFUSE_SAMPLE_RATE", "1"))
    except ValueError:
        return None
    return TraceIdRatioBased(rate) if 0 <= rate < 1 else None


def reward_scores(trajectory: Trajectory) -> list[tuple[str, float, str | None]]:
    """``(name, value, comment)`` for the reward and each component a trajectory's scorers left behind."""
    error = trajectory.metadata.get("reward_error")
    if "reward_components" in trajectory.metadata:  # scored again since (score_group, RULER): not that reward
        error = None
    scores: list[tuple[str, float, str | None]] = [
        ("reward", float(trajectory.reward), f"reward function raised {error}" if error else None)]
    components = str(trajectory.metadata.get("reward_components") or "").split(",")
    for name in filter(None, components):
        if name != "ruler" and isinstance(trajectory.metrics.get(name), int | float):
            scores.append((name, float(trajectory.metrics[name]), None))
    if "ruler_score" in trajectory.metrics:
        explanations = [line for line in trajectory.logs if line.startswith("RULER (")]
        scores.append(("ruler", float(trajectory.metrics["ruler_score"]), "\n".join(explanations) or None))
    return scores


def _usage(prompt: int, completion: int | None) -> dict[str, int]:
    """Langfuse's ``usage_details`` of a call: input, and output and total once the completion is counted."""
    return {"input": prompt} if completion is None else {"input": prompt, "output": completion,
                                                         "total": prompt + completion}


def _instrument_agents_sdk(tracer_provider: Any) -> None:
    """Install the OpenInference instrumentation for the Agents SDK once per process (it is global)."""
    from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor

    instrumentor = OpenAIAgentsInstrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument(tracer_provider=tracer_provider)


def _task_text(value: Any, limit: int = 200) -> str:
    """A short label for a rollout's input: the last user message's text, else its JSON."""
    text = None
    messages = value.get("messages") if isinstance(value, dict) else value if isinstance(value, list) else None
    if isinstance(value, str):
        text = value
    elif isinstance(messages, list):
        for message in reversed(messages):
            if isinstance(message, tuple) and len(message) == 2 and message[0] in ("user", "human"):
                text = str(message[1])
            elif isinstance(message, dict) and message.get("role") == "user":
                text = str(message.get("content"))
            elif getattr(message, "type", None) == "human":
                text = str(getattr(message, "content", ""))
            if text is not None:
                break
    if text is None:
        text = json.dumps(plain(value), ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"
