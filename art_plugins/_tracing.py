"""What a rollout scope tells the tracers watching it: the seam between capturing a run and tracing it.

A ``Tracer`` (``art_plugins.langfuse.LangfuseTracing``; an MLflow one would be another) is asked once per
rollout for a ``RolloutObserver``, which the scope (``art_plugins._rollout.RolloutScope``) then tells, in order:

    observer = tracer.start_rollout(info)         # the scope is made: model, framework, ids, the run's input
    observer.enter()                              # the scope opens, in the run's own context
    config["callbacks"] += observer.langchain_callbacks()   # LangGraph runs: handlers nested under the rollout
    observer.on_call(call)                        # each routed call the gateway answered, in the task making it
    observer.exit(error)                          # the scope closes, in the same context as ``enter``
    observer.end()                                # the run has ended (later than ``exit`` for a run that
                                                  # outlives its scope: a streamed Agents SDK run)
    observer.link(trajectory)                     # the trajectory is built, before scoring
    observer.finish(trajectory)                   # the trajectory is scored

A scope takes any number of tracers (Langfuse and MLflow side by side): each gets its own observer. An observer
must never raise (tracing must not fail a rollout): it counts and reports its own failures. An Agents SDK run
with any observer runs with the SDK's tracing on, since tracers read the SDK's spans (OpenInference, MLflow's
autologging).

This module imports nothing beyond the standard library: the scope, the adapters and every tracer depend on
it, and it on none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from art_core import TrainableModel, Trajectory

__all__ = ["RolloutInfo", "RolloutObserver", "RoutedCall", "Tracer", "rollout_tracers", "tracing_rollouts"]


@dataclass(frozen=True)
class RolloutInfo:
    """What a tracer learns about a rollout when its scope is made."""

    model: TrainableModel
    """The trainable model (``name``, ``project``, ``step``: the checkpoint the rollout samples from)."""
    framework: str
    """``"langgraph"`` or ``"openai-agents"``."""
    rollout_id: str
    """The gateway's id for the rollout's calls (``model.rollout_records(rollout_id)``)."""
    trajectory_id: str
    """The id the rollout's trajectory will have (chosen before the run, so a trace can be named after it)."""
    input: Any
    """The run's input, as the adapter was given it."""
    group_id: str | None
    """The group the rollout belongs to (``gather_group``), or None."""


class RoutedCall:
    """What the gateway said about one routed call: its response headers (``art_core.wire``), read once.

    ``completion_tokens`` is None for a live stream, whose headers leave before any token is sampled: its count
    comes later, from the gateway's record once the body has been read (``when_complete``).
    """

    __slots__ = ("_waiting", "adapter_step", "completion_tokens", "prompt_tokens", "request_id")

    def __init__(self, *, request_id: str | None, adapter_step: int, prompt_tokens: int,
                 completion_tokens: int | None) -> None:
        self.request_id = request_id
        """The gateway's record of the call (``CallRecord.request_id``)."""
        self.adapter_step = adapter_step
        """The checkpoint that served the call (0: the base model)."""
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self._waiting: list[Callable[[int | None], None]] | None = None if completion_tokens is not None else []

    def when_complete(self, callback: Callable[[int | None], None]) -> None:
        """Call ``callback(completion_tokens)`` once the count is known: now, when the headers carried it, else
        when the body has been read (None if the gateway's record of the call could not be read)."""
        if self._waiting is None:
            callback(self.completion_tokens)
        else:
            self._waiting.append(callback)

    def complete(self, completion_tokens: int | None) -> None:
        """Set the count of a streamed call and run the callbacks waiting for it (once; the scope calls this)."""
        waiting, self._waiting = self._waiting, None
        if waiting is None:
            return
        self.completion_tokens = completion_tokens
        for callback in waiting:
            callback(completion_tokens)


class RolloutObserver(Protocol):
    """One tracer's view of one rollout (see the module docstring for the order of calls). Never raises."""

    def enter(self) -> None:
        """The scope opened, in the context the run executes in: start the rollout's trace (make it current)."""

    def exit(self, error: BaseException | None) -> None:
        """The scope closed, in the context of ``enter``: undo what ``enter`` made current. The run may go on."""

    def end(self) -> None:
        """The run has ended: end the rollout's trace. Called once, after ``exit`` (or without ``enter`` when the
        run failed to start)."""

    def langchain_callbacks(self) -> list[Any]:
        """LangChain callback handlers to add to a LangGraph run's config (empty: none)."""

    def on_call(self, call: RoutedCall) -> None:
        """A routed call was answered: called in the task that made the call, while the framework's own
        observation of it (if any) is the current span."""

    def link(self, trajectory: Trajectory) -> None:
        """The rollout's trajectory was built (not yet scored): note the trace on it (``trajectory.metadata``)."""

    def finish(self, trajectory: Trajectory) -> None:
        """The trajectory was scored: send its reward (and reward components)."""


class Tracer(Protocol):
    """Traces rollouts somewhere (Langfuse, MLflow...): one observer per rollout."""

    def start_rollout(self, info: RolloutInfo) -> RolloutObserver:
        """The observer of one rollout (called when its scope is made, in the run's context)."""


_ambient: ContextVar[tuple[Tracer, ...]] = ContextVar("art_plugins_ambient_tracers", default=())


@contextmanager
def tracing_rollouts(*tracers: Tracer) -> Iterator[None]:
    """Trace every rollout an adapter runs in the code inside (and the tasks it starts) with ``tracers`` too,
    whatever the adapter's own options say: how a dataset run (``evaluate``) traces the rollouts it drives."""
    token = _ambient.set((*_ambient.get(), *tracers))
    try:
        yield
    finally:
        _ambient.reset(token)


def rollout_tracers(own: Sequence[Tracer]) -> tuple[Tracer, ...]:
    """The tracers of a rollout an adapter starts now: its own, then those of ``tracing_rollouts`` (each once)."""
    ambient = _ambient.get()
    if not ambient:
        return tuple(own)
    chosen = list(own)
    chosen += [t for t in ambient if not any(t is c for c in chosen)]
    return tuple(chosen)
