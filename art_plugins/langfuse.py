"""Langfuse for training runs: every rollout a trace, every reward a score, every step a link.

    agent = trainable(graph, model, langfuse=True)          # or TrainableRunner(model, langfuse=True)
    group = await agent.group(task, n=8, reward=my_reward)  # 8 traces, rewards as scores
    await model.train([group])                              # a "training-step" trace; best/worst links printed
    run = await evaluate(agent, "my-dataset", run_name="before")   # a Langfuse dataset run

``langfuse=True`` builds a ``Langfuse`` client from ``LANGFUSE_PUBLIC_KEY``, ``LANGFUSE_SECRET_KEY`` and
``LANGFUSE_BASE_URL``; pass a ``Langfuse`` client, or a ``LangfuseTracing`` for more options. Off (the
default), the adapters import nothing from here and send nothing.

What goes where (names as they appear in Langfuse):

- **Rollout traces** (trace name ``rollout``): the trace id is ``Langfuse.create_trace_id(seed=trajectory.id)``
  and is kept in ``trajectory.metadata["langfuse_trace_id"]``. Session id: the training run
  (``"<project>/<model name>"`` unless ``session_id=``). Trace metadata: ``model``, ``step``, ``group``,
  ``task``, ``framework``, ``rollout_id``, ``trajectory_id``. Under the root observation ``rollout`` sits the
  framework's own structure: LangGraph's graph, nodes, LLM calls and tools through Langfuse's LangChain
  ``CallbackHandler``; the Agents SDK's workflow, agents, LLM calls, tools, handoffs and guardrails through
  the OpenInference instrumentation Langfuse documents for it.
- **Trainable calls**: each LLM observation that called the trainable model carries, as metadata,
  ``rollout_id``, ``adapter_step`` (the checkpoint that served it), ``request_id`` (the gateway record),
  ``prompt_tokens`` and ``completion_tokens``, and the same counts as its usage. They come from the
  gateway's response headers, read in the task that made the call while the framework's observation is the
  current OpenTelemetry span; a live-streamed call's headers leave before any token is sampled, so its
  completion count is read from the gateway's record of the call when its body has been read (still inside
  the observation). In LangGraph's node observations, the graph state's LangChain messages are shown
  compactly, as Langfuse shows a generation's (role, content, tool calls); routing functions get no
  observation of their own (the route they chose is their node's metadata ``langgraph_route``) and LangGraph's
  bookkeeping metadata is left out (see ``art_plugins._langfuse_langchain``).
- **Scores** on each rollout trace: ``reward``; each custom reward component of ``score_group`` by its name;
  ``ruler`` with the judge's explanation as the comment. Sent when the rollout is scored and again when
  the step trains (same score ids: the final values replace the first ones, e.g. after RULER).
- **Step traces** (trace name ``training-step``): the step's metrics as output, its trajectories' trace ids
  (also written to ``history.jsonl`` as ``langfuse_trace_ids``); the best and worst trajectory's URLs are
  printed when the step ends.
- **Dataset runs** (``evaluate``): each dataset item runs once through the agent inside Langfuse's
  experiment runner (``DatasetClient.run_experiment``), so the item is linked to its trace and the reward
  scores are attached; runs before and after training sit side by side under the dataset.

Faults: a Langfuse that is down, failing or hanging never fails a rollout, a step or an evaluation. Spans
and scores leave in the SDK's background threads; each step waits at most ``flush_timeout`` seconds for
them; export errors the SDK logs are counted and reported once per step (a warning with the count).

Global effects, each installed once, when Langfuse is first turned on: for the Agents SDK, the OpenInference
instrumentation (``OpenAIAgentsInstrumentor().instrument()``) registers a trace processor with the SDK, which
exports every traced Agents SDK run of the process to Langfuse, as Langfuse's own setup does; with Langfuse
on, art-plugins' runs are traced (``RunConfig.tracing_disabled`` is False), so the SDK's own exporter sees
them too (it sends to OpenAI only with an OpenAI key set; ``agents.set_tracing_disabled`` or
``set_trace_processors`` control it). A logging handler counts the errors of the ``langfuse`` and
OpenTelemetry exporter loggers while a ``LangfuseTracing`` is open (``aclose()`` removes it). The client made
for ``langfuse=True`` gets its own OpenTelemetry ``TracerProvider``: the global one is left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

from art_core import TrainableModel, Trajectory, TrajectoryGroup
from art_core.errors import ConfigError
from art_core.wire import (
    ADAPTER_STEP_HEADER,
    COMPLETION_TOKENS_HEADER,
    PROMPT_TOKENS_HEADER,
    REQUEST_ID_HEADER,
)
from art_core.types import TRACE_ID_KEY

from ._rollout import RewardFn, RolloutScope, current_group_id

try:
    from langfuse import Langfuse, LangfuseOtelSpanAttributes, propagate_attributes
    from opentelemetry import trace as otel_trace
    from opentelemetry.sdk.trace import TracerProvider
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("art_plugins.langfuse needs the Langfuse SDK: pip install 'art-plugins[langfuse]'") from exc

if TYPE_CHECKING:
    from langfuse.api import DatasetItem

__all__ = ["DatasetRun", "LangfuseOption", "LangfuseTracing", "current_dataset_item", "evaluate"]

logger = logging.getLogger(__name__)

LangfuseOption: TypeAlias = "bool | Langfuse | LangfuseTracing | None"
"""What ``trainable(..., langfuse=)`` and ``TrainableRunner(..., langfuse=)`` take."""

ROLLOUT_TRACE_NAME = "rollout"
STEP_TRACE_NAME = "training-step"
_FAILURE_LOGGERS = ("langfuse", "opentelemetry.exporter", "opentelemetry.sdk.trace.export")
_METADATA = LangfuseOtelSpanAttributes.OBSERVATION_METADATA
_USAGE_KEY = LangfuseOtelSpanAttributes.OBSERVATION_USAGE_DETAILS
_ROLLOUT_ID_KEY, _ADAPTER_STEP_KEY, _REQUEST_ID_KEY, _PROMPT_TOKENS_KEY, _TRAINABLE_KEY, _COMPLETION_TOKENS_KEY = (
    f"{_METADATA}.{key}" for key in ("rollout_id", "adapter_step", "request_id", "prompt_tokens", "trainable",
                                     "completion_tokens"))
_LLM_SPAN_MARKS = ((LangfuseOtelSpanAttributes.OBSERVATION_TYPE, "generation"),  # Langfuse's LangChain handler
                   ("openinference.span.kind", "LLM"))                            # OpenInference (Agents SDK)


class LangfuseTracing:
    """Sends a training run to Langfuse: rollouts as traces, rewards as scores, steps as traces.

    Args:
        client: a ``Langfuse`` client. Default: one built from ``LANGFUSE_PUBLIC_KEY``, ``LANGFUSE_SECRET_KEY``
            and ``LANGFUSE_BASE_URL`` (and the SDK's other ``LANGFUSE_*`` variables), with a tracer provider
            of its own so the process's global OpenTelemetry provider stays as it was.
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
            client = Langfuse(tracer_provider=TracerProvider(shutdown_on_exit=False))
        elif not isinstance(client, Langfuse):
            raise ConfigError(f"langfuse= takes True, a langfuse.Langfuse client or a LangfuseTracing, got "
                              f"{type(client).__name__}")
        self.client = client
        self.session_id = session_id
        self.flush_timeout = flush_timeout
        self.print_links = print_links
        # The SDK has no public accessor for these two; both are needed to reach the same client from the
        # LangChain handler (which looks clients up by public key) and to give OpenInference the provider.
        resources = getattr(client, "_resources", None)
        self.public_key: str | None = getattr(resources, "public_key", None)
        self.tracer_provider: Any = getattr(resources, "tracer_provider", None) or otel_trace.get_tracer_provider()
        self.failures = _FailureCounter()
        self._reported = 0
        self._flushing: asyncio.Future[Any] | None = None
        self._detach: dict[int, Callable[[], None]] = {}  # id(model) -> removes the step hook
        self._trace_ids: set[str] = set()  # rollout traces made here, not yet reported by a step
        self._closed = False
        _failure_handlers.acquire(self.failures)

    def __repr__(self) -> str:
        return f"LangfuseTracing(public_key={self.public_key!r}, session_id={self.session_id!r})"

    # -- wiring -----------------------------------------------------------------------------------------

    def attach(self, model: TrainableModel) -> None:
        """Trace ``model``'s training steps (once per model, however many adapters share it)."""
        if id(model) not in self._detach:
            self._detach[id(model)] = model.add_step_hook(self.on_step)

    def session_for(self, model: TrainableModel) -> str:
        """The Langfuse session id of ``model``'s traces: ``session_id``, else ``"<project>/<model name>"``."""
        return self.session_id or f"{model.project}/{model.name}"

    def rollout(self, scope: RolloutScope, *, input: Any) -> RolloutTrace:
        """The trace of one rollout (a context manager around the run); see ``RolloutTrace``."""
        if scope.framework == "openai-agents":
            _instrument_agents_sdk(self.tracer_provider)
        return RolloutTrace(self, scope, input)

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
                span.update(output=_plain(metrics))
        return trace_id

    async def _links(self, step_trace_id: str | None, trajectories: list[Trajectory]) -> list[str]:
        if not trajectories:
            return []
        best = max(trajectories, key=lambda t: t.reward)
        worst = min(trajectories, key=lambda t: t.reward)
        wanted = [("step", step_trace_id, None), ("best", best.metadata[TRACE_ID_KEY], best),
                  ("worst", worst.metadata[TRACE_ID_KEY], worst)]
        try:
            done, urls = await _bounded(lambda: [self.client.get_trace_url(trace_id=str(tid)) if tid else None
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
            done, _ = await _bounded(self.client.flush, timeout or self.flush_timeout, keep=self._keep_flush)
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
        """Flush (bounded) and shut the client down if this object made it; remove the failure counter."""
        if self._closed:
            return
        self._closed = True
        try:
            await _bounded(self.client.shutdown, timeout or self.flush_timeout)
        except Exception as exc:
            self.failures.note(f"shutdown: {exc}")
        _failure_handlers.release(self.failures)
        for detach in self._detach.values():
            detach()
        self._detach.clear()


class RolloutTrace:
    """One rollout's trace: open it around the run (``with``), then ``link`` and ``finish`` the trajectory.

    Inside, the rollout's root observation is the current OpenTelemetry span, trace-level attributes are
    propagated to every observation started in the run, and each routed call's gateway headers are written
    onto the framework's LLM observation (see the module docstring).
    """

    def __init__(self, tracing: LangfuseTracing, scope: RolloutScope, input: Any) -> None:
        self.tracing = tracing
        self.scope = scope
        self.input = input
        self.outlives_scope = False
        """Set for a run whose task outlives the ``with`` that starts it (``run_streamed``): leaving the ``with``
        then only detaches the trace's context (the task copied it), and ``close()`` ends the trace."""
        self.item = _dataset_item.get()
        # In a dataset run the trace is the one Langfuse's experiment runner opened for the item.
        self.trace_id = (tracing.client.get_current_trace_id() if self.item is not None else None) \
            or Langfuse.create_trace_id(seed=scope.trajectory_id)
        self.root: Any = None
        self._rollout_id_json = json.dumps(scope.rollout_id)
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> RolloutTrace:
        model, client = self.scope.model, self.tracing.client
        labels = {"model": model.name, "step": str(model.step), "group": current_group_id() or "",
                  "task": _task_text(self.input), "framework": self.scope.framework,
                  "rollout_id": self.scope.rollout_id, "trajectory_id": self.scope.trajectory_id}
        try:
            self._stack.enter_context(propagate_attributes(
                session_id=self.tracing.session_for(model), metadata=labels,
                trace_name=None if self.item is not None else ROLLOUT_TRACE_NAME))
            self.root = self._stack.enter_context(client.start_as_current_observation(
                trace_context=None if self.item is not None else {"trace_id": self.trace_id},
                name=ROLLOUT_TRACE_NAME, as_type="agent", input=_plain(self.input), metadata=labels,
                end_on_exit=not self.outlives_scope))
        except Exception as exc:  # tracing must never stop the rollout
            self.tracing.failures.note(f"rollout trace: {exc}")
        self.scope.route.on_response = self.on_response
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self._stack.__exit__(*exc_info)
        except Exception as exc:
            self.tracing.failures.note(f"rollout trace: {exc}")
        if not self.outlives_scope:
            self.scope.route.on_response = None

    def close(self) -> None:
        """End a trace that outlived its scope (``outlives_scope``), once its run has ended; idempotent."""
        self.scope.route.on_response = None
        root, self.root = (self.root, None) if self.outlives_scope else (None, self.root)
        if root is not None:
            try:
                root.end()
            except Exception as exc:
                self.tracing.failures.note(f"rollout trace: {exc}")

    def langchain_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` with Langfuse's LangChain ``CallbackHandler`` added, its runs nested under the rollout."""
        context = {"trace_id": self.trace_id}
        if self.root is not None:
            context["parent_span_id"] = self.root.id
        handler = _compact_handler_type()(public_key=self.tracing.public_key, trace_context=context)
        # Inline, LangChain calls it in the task making the LLM call, so its generation is the current span
        # while the request is sent and ``on_response`` can write the gateway's answer onto it.
        handler.run_inline = True
        callbacks = config.get("callbacks")
        if callbacks is None or isinstance(callbacks, list):
            return {**config, "callbacks": [*(callbacks or []), handler]}
        manager = callbacks.copy()
        manager.add_handler(handler, inherit=True)
        return {**config, "callbacks": manager}

    def on_response(self, response: Any) -> None:
        """Write what the gateway says about a routed call onto the observation making it."""
        try:
            headers = response.headers
            step = headers.get(ADAPTER_STEP_HEADER)
            if step is None:
                return
            prompt = int(headers.get(PROMPT_TOKENS_HEADER, 0))
            request_id = headers.get(REQUEST_ID_HEADER)
            # A live stream's headers leave before its tokens are sampled: its completion count is read from
            # the gateway's record once the body has been read (the gateway records before the last chunk).
            completion = headers.get(COMPLETION_TOKENS_HEADER)
            span = otel_trace.get_current_span()
            attributes = getattr(span, "attributes", None) or {}
            if span.is_recording() and any(attributes.get(k) == v for k, v in _LLM_SPAN_MARKS):
                # The attributes ``update(metadata=...)`` would write (each value JSON-encoded), set directly:
                # ints and the rollout id's JSON (encoded once per rollout) need no encoder.
                span.set_attributes({_ROLLOUT_ID_KEY: self._rollout_id_json, _ADAPTER_STEP_KEY: str(int(step)),
                                     _REQUEST_ID_KEY: json.dumps(request_id), _PROMPT_TOKENS_KEY: str(prompt),
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
                facts = {"rollout_id": self.scope.rollout_id, "adapter_step": int(step), "request_id": request_id,
                         "prompt_tokens": prompt, "trainable": True}
                parent = {"parent_span_id": self.root.id} if self.root else {}
                generation = self.tracing.client.start_observation(
                    trace_context={"trace_id": self.trace_id, **parent}, name="trainable-call", as_type="generation",
                    model=self.scope.model.name, metadata=facts)

                def write(count: int | None) -> None:
                    generation.update(usage_details=_usage(prompt, count),
                                      metadata=None if count is None else {"completion_tokens": count})
                    generation.end()
            if completion is not None:
                write(int(completion))
            elif not _on_body_end(response, lambda: self._written(write, request_id)):
                self._written(write, request_id)  # the body was read already: the record is there
        except Exception as exc:
            self.tracing.failures.note(f"call observation: {exc}")

    def _written(self, write: Callable[[int | None], None], request_id: str | None) -> None:
        """``write`` the streamed call's completion count, from the gateway's record of ``request_id``."""
        try:
            records = self.scope.model.rollout_records(self.scope.rollout_id)
            record = next((r for r in reversed(records) if r.request_id == request_id), None)
            write(len(record.completion_token_ids) if record is not None else None)
        except Exception as exc:
            self.tracing.failures.note(f"call observation: {exc}")

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


def _usage(prompt: int, completion: int | None) -> dict[str, int]:
    """Langfuse's ``usage_details`` of a call: input, and output and total once the completion is counted."""
    return {"input": prompt} if completion is None else {"input": prompt, "output": completion,
                                                         "total": prompt + completion}


_stream_types: dict[type, type] = {}


def _on_body_end(response: Any, done: Callable[[], None]) -> bool:
    """Call ``done()`` once, when ``response``'s body has been read to its end or closed.

    The body stream (httpx's or httpx2's byte stream, sync or async) is wrapped in place; False when the body
    was read already (nothing is left to wait for).
    """
    if getattr(response, "is_stream_consumed", False) or getattr(response, "is_closed", False):
        return False
    inner = response.stream
    base = next((b for b in type(inner).__mro__ if b.__name__ in ("AsyncByteStream", "SyncByteStream")), None)
    if base is None:
        return False
    wrapper = _stream_types.get(base)
    if wrapper is None:
        wrapper = _stream_types[base] = _body_end_stream(base)
    response.stream = wrapper(inner, done)
    return True


def _body_end_stream(base: type) -> type:
    """A subclass of ``base`` (a sync or async byte stream) that passes ``inner`` through and calls ``done`` once
    at its end or close."""
    def fire(self: Any) -> None:
        done, self._done = self._done, None
        if done is not None:
            done()

    def init(self: Any, inner: Any, done: Callable[[], None]) -> None:
        self._inner, self._done = inner, done

    if base.__name__ == "AsyncByteStream":
        async def aiter(self: Any) -> Any:
            async for chunk in self._inner:
                yield chunk
            fire(self)

        async def aclose(self: Any) -> None:
            try:
                await self._inner.aclose()
            finally:
                fire(self)
        return type("BodyEndStream", (base,), {"__init__": init, "__aiter__": aiter, "aclose": aclose})

    def sync_iter(self: Any) -> Any:
        yield from self._inner
        fire(self)

    def close(self: Any) -> None:
        try:
            self._inner.close()
        finally:
            fire(self)
    return type("BodyEndStream", (base,), {"__init__": init, "__iter__": sync_iter, "close": close})


def reward_scores(trajectory: Trajectory) -> list[tuple[str, float, str | None]]:
    """``(name, value, comment)`` for the reward and each component a trajectory's scorers left behind."""
    error = trajectory.metadata.get("reward_error")
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


# --- choosing the tracing for an adapter ---------------------------------------------------------------

_default: LangfuseTracing | None = None
_by_client: weakref.WeakKeyDictionary[Langfuse, LangfuseTracing] = weakref.WeakKeyDictionary()
_resolve_lock = threading.Lock()


def resolve(option: Any, model: TrainableModel) -> LangfuseTracing | None:
    """The ``LangfuseTracing`` an adapter's ``langfuse=`` option means (None: off), attached to ``model``.

    Raises:
        ConfigError: the option is not one of False/None, True, a ``Langfuse`` client or a ``LangfuseTracing``.
    """
    global _default
    if option is None or option is False:
        return None
    with _resolve_lock:
        if option is True:
            if _default is None or _default._closed:
                _default = LangfuseTracing()
            tracing = _default
        elif isinstance(option, LangfuseTracing):
            tracing = option
        elif isinstance(option, Langfuse):
            tracing = _by_client.get(option)
            if tracing is None or tracing._closed:
                tracing = _by_client[option] = LangfuseTracing(option)
        else:
            raise ConfigError(f"langfuse= takes True, False, a langfuse.Langfuse client or a LangfuseTracing, got "
                              f"{type(option).__name__}")
    tracing.attach(model)
    return tracing


def rollout_trace(option: Any, scope: RolloutScope, input: Any) -> RolloutTrace | None:
    """The trace for one rollout, or None when Langfuse is off for it (and no dataset run is going on)."""
    tracing = resolve(option, scope.model)
    if tracing is None:
        tracing = _evaluation_tracing.get()
    return tracing.rollout(scope, input=input) if tracing is not None else None


# --- datasets --------------------------------------------------------------------------------------------

_dataset_item: ContextVar[Any] = ContextVar("art_plugins_langfuse_item", default=None)
_evaluation_tracing: ContextVar[LangfuseTracing | None] = ContextVar("art_plugins_langfuse_eval", default=None)


def current_dataset_item() -> DatasetItem | None:
    """The Langfuse dataset item being evaluated (``input``, ``expected_output``, ``metadata``), in ``evaluate``.

    Reward functions read the expected output here: ``current_dataset_item().expected_output``.
    """
    return _dataset_item.get()


@dataclass
class DatasetRun:
    """What ``evaluate`` returns."""

    dataset: str
    run_name: str
    experiment_id: str | None
    """Langfuse's id of the dataset run (None when the run's end was not seen within the flush timeout)."""
    url: str | None
    """The run's page in Langfuse, when the project id could be read."""
    trajectories: TrajectoryGroup
    """One scored trajectory per item that ran (``metadata["langfuse_dataset_item_id"]`` says which)."""
    failures: list[str] = field(default_factory=list)
    """Items whose rollout raised, as ``"item <id>: ExceptionType: message"``."""

    @property
    def mean_reward(self) -> float | None:
        rewards = self.trajectories.rewards
        return sum(rewards) / len(rewards) if rewards else None


async def evaluate(target: Any, dataset: str, *, run_name: str, agent: Any = None, reward: RewardFn | None = None,
                   input: Callable[[Any], Any] | None = None, langfuse: Any = True, description: str | None = None,
                   max_concurrency: int = 4, metadata: Mapping[str, str] | None = None) -> DatasetRun:
    """Run a trainable graph or agent on every item of a Langfuse dataset, recorded as a dataset run.

    Each item's input goes through one rollout inside Langfuse's experiment runner, so Langfuse links the
    item to the rollout's trace and attaches its scores (``reward`` and the components); evaluate before
    and after training under two ``run_name`` s to compare them side by side.

    Args:
        target: a ``TrainableGraph`` (``trainable(graph, model)``) or a ``TrainableRunner``.
        dataset: the Langfuse dataset's name.
        run_name: the dataset run's name (e.g. ``"step-0"``).
        agent: for a ``TrainableRunner``, the starting agent.
        reward: ``reward(trajectory, final_state)``; ``current_dataset_item()`` gives the item's expected output.
        input: turns an item's ``input`` into the agent's input. Default: a string becomes a user message
            (``{"messages": [("user", text)]}`` for a graph, the text itself for an agent); anything else is
            passed as it is.
        langfuse: the client to use (as for the adapters); default: the adapter's, else ``True``.
        description, metadata: stored with the run.
        max_concurrency: items run at once.

    Raises:
        ConfigError: the target is neither adapter, an agent is missing, or the dataset cannot be read.
    """
    model, run_one = _evaluation_target(target, agent, reward, input)
    tracing = resolve(getattr(target, "langfuse", None) or langfuse, model)
    if tracing is None:
        raise ConfigError("evaluate() records a Langfuse dataset run: pass langfuse=True or a client")
    try:
        done, items = await _bounded(lambda: tracing.client.get_dataset(dataset), tracing.flush_timeout * 4)
    except Exception as exc:
        raise ConfigError(f"could not read the Langfuse dataset {dataset!r}: {exc}") from exc
    if not done:
        raise ConfigError(f"could not read the Langfuse dataset {dataset!r}: no answer within "
                          f"{tracing.flush_timeout * 4} s")
    loop = asyncio.get_running_loop()
    trajectories: dict[str, Trajectory] = {}
    failures: list[str] = []
    finished = asyncio.Event()
    pending = [len(items.items)]

    async def one(item: Any) -> dict[str, Any]:
        try:
            trajectory = await run_one(item)
        except Exception as exc:
            failures.append(f"item {item.id}: {type(exc).__name__}: {exc}")
            raise
        finally:
            pending[0] -= 1
            if pending[0] <= 0:
                finished.set()
        trajectories[trajectory.id] = trajectory
        return {"output": trajectory.metadata.get("final_output") or _plain(trajectory.final_state),
                "trajectory_id": trajectory.id}

    async def task(*, item: Any, **_: Any) -> Any:
        # Langfuse runs the experiment in a thread with its own event loop; the rollout must run on ours
        # (the gateway and the agent's clients live there). The context, OpenTelemetry's included, goes along.
        item_token, tracing_token = _dataset_item.set(item), _evaluation_tracing.set(tracing)
        try:
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(one(item), loop))
        finally:
            _dataset_item.reset(item_token)
            _evaluation_tracing.reset(tracing_token)

    def scores(*, output: Any, **_: Any) -> list[Any]:
        from langfuse import Evaluation

        trajectory = trajectories.get(output.get("trajectory_id")) if isinstance(output, dict) else None
        if trajectory is None:
            return []
        return [Evaluation(name=name, value=value, comment=comment, data_type="NUMERIC")
                for name, value, comment in reward_scores(trajectory)]

    outcome: dict[str, Any] = {}

    def run_experiment() -> None:
        outcome["result"] = items.run_experiment(name=run_name, run_name=run_name, description=description,
                                                 task=task, evaluators=[scores], max_concurrency=max_concurrency,
                                                 metadata=dict(metadata or {}))

    runner = threading.Thread(target=run_experiment, name="art-langfuse-experiment", daemon=True)
    runner.start()
    if items.items:
        await finished.wait()  # every rollout ran: from here on only Langfuse's own sending remains
    # The runner ends with a flush of its own: wait for it at most flush_timeout (it may hang on the network).
    deadline = loop.time() + tracing.flush_timeout
    while runner.is_alive() and loop.time() < deadline:
        await asyncio.sleep(0.05)
    result = outcome.get("result")
    if result is None:
        tracing.failures.note(f"dataset run {run_name!r}: Langfuse's experiment runner did not finish in time")
    group = TrajectoryGroup(trajectories.values(), metadata={"langfuse_dataset": dataset, "run_name": run_name})
    return DatasetRun(dataset=dataset, run_name=run_name, experiment_id=getattr(result, "experiment_id", None),
                      url=getattr(result, "experiment_url", None), trajectories=group, failures=failures)


def _evaluation_target(target: Any, agent: Any, reward: RewardFn | None, input: Callable[[Any], Any] | None
                       ) -> tuple[TrainableModel, Callable[[Any], Any]]:
    from .langgraph import TrainableGraph

    if isinstance(target, TrainableGraph):
        convert = input or (lambda value: {"messages": [("user", value)]} if isinstance(value, str) else value)

        async def run_graph(item: Any) -> Trajectory:
            return await target.rollout(convert(item.input), reward=reward)
        return target.model, run_graph
    runner_type = _runner_type()
    if runner_type is not None and isinstance(target, runner_type):
        if agent is None:
            raise ConfigError("evaluate() on a TrainableRunner needs agent=<the starting agent>")
        convert = input or (lambda value: value)

        async def run_agent(item: Any) -> Trajectory:
            _, trajectory = await target.run(agent, convert(item.input), reward=reward)
            return trajectory
        return target.model, run_agent
    raise ConfigError(f"evaluate() takes a TrainableGraph or a TrainableRunner, got {type(target).__name__}")


def _runner_type() -> type | None:
    try:
        from .openai_agents import TrainableRunner
    except ImportError:
        return None
    return TrainableRunner


# --- helpers ---------------------------------------------------------------------------------------------


def _instrument_agents_sdk(tracer_provider: Any) -> None:
    """Install the OpenInference instrumentation for the Agents SDK once per process (it is global)."""
    from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor

    instrumentor = OpenAIAgentsInstrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument(tracer_provider=tracer_provider)


_handler_type: type | None = None


def _compact_handler_type() -> type:
    """The LangChain handler of LangGraph rollouts (``_langfuse_langchain.LightStateHandler``), imported when used."""
    global _handler_type
    if _handler_type is None:
        from ._langfuse_langchain import LightStateHandler

        _handler_type = LightStateHandler
    return _handler_type


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
        text = json.dumps(_plain(value), ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _plain(value: Any) -> Any:
    """JSON-friendly (tuples to lists, pydantic models dumped, the rest as text)."""
    try:
        return json.loads(json.dumps(value, default=lambda v: v.model_dump() if hasattr(v, "model_dump") else str(v)))
    except (TypeError, ValueError):
        return str(value)


async def _bounded(fn: Callable[[], Any], timeout: float, *,
                   keep: Callable[[asyncio.Future[Any]], None] | None = None) -> tuple[bool, Any]:
    """``fn()`` in a daemon thread, waited for at most ``timeout`` s: ``(finished, result)``.

    A daemon thread, not the loop's executor: a call stuck on the network must not hold up the event loop,
    the step, or the interpreter's exit. Its exception, if it finished with one, is raised.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def run() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (fn(), None)
        except BaseException as exc:
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(_settle, future, *outcome)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for this any more
            pass

    # Given up on, the call may still end with an error later: retrieve it, so asyncio does not log it as lost.
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    thread = threading.Thread(target=run, name="art-langfuse", daemon=True)
    thread.start()
    if keep is not None:
        keep(future)
    try:
        return True, await asyncio.wait_for(asyncio.shield(future), timeout)
    except TimeoutError:
        return False, None


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class _FailureCounter(logging.Handler):
    """Counts the errors the Langfuse SDK and the OpenTelemetry exporter log (failed exports, dropped scores)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0
        self.last: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:
            message = str(record.msg)
        self.note(message)

    def note(self, message: str) -> None:
        self.count += 1
        self.last = message[:300]


class _Handlers:
    """Keeps the failure counters on the SDK's loggers while any ``LangfuseTracing`` is open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def acquire(self, handler: logging.Handler) -> None:
        with self._lock:
            for name in _FAILURE_LOGGERS:
                logging.getLogger(name).addHandler(handler)

    def release(self, handler: logging.Handler) -> None:
        with self._lock:
            for name in _FAILURE_LOGGERS:
                logging.getLogger(name).removeHandler(handler)


_failure_handlers = _Handlers()
