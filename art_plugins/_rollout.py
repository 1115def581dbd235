"""One captured agent run: the scope the adapters open, and what they share.

    scope = RolloutScope(model, framework="langgraph")
    async with scope:               # calls for the trainable model now go to the rollout's gateway URL
        state = await graph.ainvoke(...)
    trajectory = scope.trajectory(final_state=state)
    await score(trajectory, reward)

The trajectory is rebuilt from the gateway's records of the rollout (``art_core.trajectories``), so every
trainable call in it is token-exact by construction. Tracers (``art_plugins._tracing``: Langfuse, ...) given to
the scope each observe the rollout: the scope tells them when it opens and closes, each routed call the gateway
answered, and the trajectory once built and once scored; it knows nothing of what they trace to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextvars import ContextVar
from types import TracebackType
from typing import TYPE_CHECKING, Any

from art_core import TrainableModel, Trajectory, TrajectoryGroup
from art_core.errors import ArtError, ConfigError
from art_core.rewards import RewardFn, reward_value
from art_core.trajectories import trajectory_from_conversations, trajectory_from_records
from art_core.wire import RolloutStatus

from ._calls import routed_call
from ._routing import Route, derive_seed, routed, wrappers_installed
from ._tracing import RolloutInfo, RolloutObserver, RoutedCall, Tracer
from .demonstrations import DEMONSTRATION_KEY, TEACHER_KEY, TeacherError

if TYPE_CHECKING:
    from ._teacher_proxy import TeacherProxy

__all__ = ["NoTrainableCallsError", "RewardFn", "RolloutScope", "check_seed", "current_group_id", "gather_group",
           "score"]

logger = logging.getLogger(__name__)

_group_id: ContextVar[str | None] = ContextVar("art_plugins_group_id", default=None)


def current_group_id() -> str | None:
    """The id ``gather_group`` gave the group the current rollout belongs to (None outside a group)."""
    return _group_id.get()


class NoTrainableCallsError(ArtError):
    """A rollout left nothing to train on: it never called the trainable model, or no call of it sampled a token."""


class RolloutScope:
    """Routes the trainable model's calls to the gateway under a fresh rollout id, as a (sync or async) context.

    Args:
        model: the registered ``TrainableModel``.
        model_names: the names the agent uses for the model; its calls naming any of them are routed.
            Default: the model's own name.
        framework: recorded in ``metadata["framework"]``.
        caller: returns the label of the part of the agent making the current call (stored per call).
        rollout_id: default: a new random id.
        seed: seeds the rollout's sampling (each call gets a seed derived from it and the call's position, unless
            the agent sets one): an agent that makes its calls in a fixed order samples the same run again.
            Default: unseeded.
        redirect: redirect HTTP calls naming the model (``_routing.routed``) while the scope is open. False
            when the adapter sends every trainable call through a client of its own (counted on ``route``).
        tracers: each observes the rollout (``art_plugins._tracing``). Default: none.
        input: the run's input, for the tracers.
        teacher: demonstration mode: the trainable model's calls go to this teacher proxy instead of the gateway,
            and the trajectory is built from its exchanges (no token ids; see ``art_plugins.demonstrations``).
            Default: None (the gateway).
    """

    def __init__(self, model: TrainableModel, *, model_names: Iterable[str] | None = None, framework: str,
                 caller: Callable[[], str | None] | None = None, rollout_id: str | None = None,
                 seed: int | None = None, redirect: bool = True, tracers: Sequence[Tracer] = (),
                 input: Any = None, teacher: TeacherProxy | None = None) -> None:
        names = frozenset(model_names) if model_names is not None else frozenset({model.name})
        check_seed(seed)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(f"model_names must be non-empty strings, got {sorted(map(repr, names))}")
        self.model = model
        self.framework = framework
        self.rollout_id = rollout_id or f"{framework}-{uuid.uuid4().hex[:16]}"
        self.teacher = teacher
        if teacher is None:
            base_url = model.rollout_base_url(self.rollout_id)  # validates the id; raises if not registered
            api_key = model.api_key
        else:  # the gateway is never asked: a model that is not registered can collect demonstrations
            base_url, api_key = teacher.rollout_base_url(self.rollout_id), teacher.api_key
        self.route = Route(model_names=names, served_name=model.name, base_url=base_url,
                           api_key=api_key, caller=caller, seed=seed)
        self.redirect = redirect
        self._scope: Any = None
        # Chosen now, not when the trajectory is built, so that a trace can be named after it while the run goes.
        self.trajectory_id = uuid.uuid4().hex[:12]
        info = RolloutInfo(model=model, framework=framework, rollout_id=self.rollout_id,
                           trajectory_id=self.trajectory_id, input=input, group_id=current_group_id())
        self.observers: tuple[RolloutObserver, ...] = tuple(tracer.start_rollout(info) for tracer in tracers)
        """One per tracer, each told what happens to the rollout (see ``art_plugins._tracing``)."""
        self._held: contextlib.ExitStack | None = None  # set by hold(): the run outlives the ``with``
        self._ended = False
        self._counting: set[asyncio.Task[None]] = set()  # streamed calls' counts being read from their records

    @property
    def traced(self) -> bool:
        """Whether any tracer observes this rollout."""
        return bool(self.observers)

    def __enter__(self) -> RolloutScope:
        if self.redirect:
            self._scope = routed(self.route)
            self._scope.__enter__()
        if self.observers:
            for observer in self.observers:
                observer.enter()
            self.route.on_response = self._on_response
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self._exit(exc_type, exc, tb)
        finally:
            explained = self.explained(exc) if exc is not None else None
            if explained is not None:
                self._note_unrouted_models(explained)
            if explained is not None and explained is not exc:
                raise explained from exc

    def _note_unrouted_models(self, error: BaseException) -> None:
        """Note on ``error`` the models this rollout's calls named that were not routed to the gateway. A chat model
        that names the trainable model otherwise than ``model_names`` fails with its own endpoint's error (a refused
        connection, a missing key), which never says that the call did not reach the gateway."""
        others = {name: count for name, count in self.route.models_seen.items() if name not in self.route.model_names}
        note = f"art-plugins: rollout {self.rollout_id} "
        if not others or not isinstance(error, Exception) or any(
                n.startswith(note) for n in getattr(error, "__notes__", ())):
            return
        seen = ", ".join(f"{name!r} ({count}x)" for name, count in others.items())
        error.add_note(f"{note}made calls naming models that are not routed to the trainable model (they went to "
                       f"their own endpoints): {seen}; routed names: {sorted(self.route.model_names)}. If the error "
                       "came from such a call and it means the trainable model, pass model_names=[...] naming it")

    def explained(self, error: BaseException) -> BaseException:
        """``error`` (what ended the run), or, when the teacher failed a call of this rollout in demonstration
        mode, a ``TeacherError`` quoting the teacher (what the agent raised only says its call failed)."""
        if self.teacher is None or not isinstance(error, Exception) or isinstance(error, TeacherError):
            return error
        failure = self.teacher.last_failure(self.rollout_id)
        return TeacherError(failure) if failure is not None else error

    def _exit(self, exc_type: type[BaseException] | None, exc: BaseException | None,
              tb: TracebackType | None) -> None:
        for observer in self.observers:
            observer.exit(exc)
        if self._held is None:
            self._end_observers()
        scope, self._scope = self._scope, None
        if scope is not None:
            scope.__exit__(exc_type, exc, tb)

    async def __aenter__(self) -> RolloutScope:
        return self.__enter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.counted()
        self.__exit__(exc_type, exc, tb)

    async def counted(self) -> None:
        """Wait until the streamed calls whose bodies have ended have their completion counts (the tracers get
        them before the rollout's traces end)."""
        while self._counting:
            await asyncio.gather(*self._counting, return_exceptions=True)

    def hold(self) -> None:
        """Keep the rollout going past the ``with`` that runs it, until ``release()``: for a run whose task outlives
        it (a streamed Agents SDK run started inside the ``with``, its task holding a copy of the route). The
        routing wrappers stay installed and the tracers' traces open. Call it before entering."""
        if self._held is None:
            self._held = contextlib.ExitStack()
            if self.redirect:
                self._held.enter_context(wrappers_installed())

    def release(self) -> None:
        """End what ``hold()`` kept going: the routing wrappers, the traces. Idempotent."""
        held, self._held = self._held, None
        if held is not None:
            held.close()
        self._end_observers()

    def langchain_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` (a LangChain ``RunnableConfig``) with the tracers' callback handlers added (call it inside)."""
        handlers = [handler for observer in self.observers for handler in observer.langchain_callbacks()]
        return _with_callbacks(config, handlers) if handlers else config

    def _end_observers(self) -> None:
        if self._ended:
            return
        self._ended = True
        self.route.on_response = None
        for observer in self.observers:
            observer.end()

    def _on_response(self, response: Any) -> None:
        """Tell the tracers what the gateway said about a routed call (``Route.on_response``; never raises)."""
        try:
            call = routed_call(response, self._count_completion)
        except Exception as exc:  # a malformed header: the call goes on, untraced
            logger.warning("rollout %s: could not read the gateway's headers of a call: %s", self.rollout_id, exc)
            return
        if call is not None:
            for observer in self.observers:
                observer.on_call(call)

    def _count_completion(self, call: RoutedCall) -> None:
        """Read a streamed call's sampled tokens from the gateway's record of it, then ``call.complete(count)``:
        on the event loop, from a task (the record may come over HTTP: the loop never waits for it); in a thread
        of synchronous code, there and then."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            call.complete(self._completion_tokens(call.request_id, self.model.rollout_records))
            return

        async def count() -> None:
            try:
                records = await self.model.fetch_rollout_records(self.rollout_id)
            except Exception as exc:
                call.complete(self._unread(call.request_id, exc))
                return
            call.complete(self._completion_tokens(call.request_id, lambda _: records))

        task = loop.create_task(count())
        self._counting.add(task)
        task.add_done_callback(self._counting.discard)

    def _completion_tokens(self, request_id: str | None, read: Callable[[str], list[Any]]) -> int | None:
        """A streamed call's sampled tokens, from the gateway's record of it (None when it cannot be read)."""
        try:
            records = read(self.rollout_id)
        except Exception as exc:  # the trace lacks the count; the rollout goes on
            return self._unread(request_id, exc)
        record = next((r for r in reversed(records) if r.request_id == request_id), None)
        return len(record.completion_token_ids) if record is not None else None

    def _unread(self, request_id: str | None, exc: Exception) -> None:
        logger.warning("rollout %s: could not read the record of call %s: %s", self.rollout_id, request_id, exc)
        return None

    async def settle(self, timeout: float = 10.0, *, grace: float = 1.0) -> None:
        """Wait (up to ``timeout`` s) until the gateway has recorded every call it was sent.

        A call cut short (the rollout's timeout, a cancelled task) is recorded by the gateway once it notices
        the client has gone, a moment after the cut: call this before ``trajectory()`` when the run was stopped.
        A call cut before its request was out (waiting for a connection) never reaches the gateway; one whose
        delivery could not be seen is waited for ``grace`` seconds only. A call whose client still waits for its
        answer (a synchronous node's thread carries on when the rollout's task is cancelled) is not waited for:
        ``trajectory()`` counts it as unanswered.
        """
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            recorded = len({r.request_id for r in await self._fetch_records()})
            if recorded >= self.route.calls_to_record and (
                    recorded >= self.route.calls_maybe_recorded or time.monotonic() - start >= grace):
                return
            await asyncio.sleep(0.01)

    async def _fetch_records(self) -> list[Any]:
        """The rollout's records so far: the gateway's, or in demonstration mode the teacher proxy's exchanges."""
        if self.teacher is not None:
            return self.teacher.exchanges(self.rollout_id)
        return await self.model.fetch_rollout_records(self.rollout_id)

    async def fetch_made_calls(self) -> bool:
        """Whether any call of this rollout was recorded (by the gateway, or the teacher proxy)."""
        return bool(await self._fetch_records())

    def made_calls(self) -> bool:
        """``fetch_made_calls``, waited for in this thread."""
        if self.teacher is not None:
            return bool(self.teacher.exchanges(self.rollout_id))
        return bool(self.model.rollout_records(self.rollout_id))

    async def fetch_trajectory(self, *, final_state: Any = None, stop_reason: str | None = None,
                               metadata: dict[str, Any] | None = None, main_caller: str | None = None) -> Trajectory:
        """``trajectory``, with the gateway's records fetched without blocking the event loop (the adapters'
        rollouts use it: with a remote backend the records come over HTTP)."""
        if self.teacher is not None:
            return self._demonstration(final_state=final_state, stop_reason=stop_reason, metadata=metadata,
                                       main_caller=main_caller)
        records = await self.model.fetch_rollout_records(self.rollout_id)
        status = await self.model.fetch_rollout_status(self.rollout_id) if self._needs_status(records) else None
        return self._trajectory(records, status, final_state=final_state, stop_reason=stop_reason,
                                metadata=metadata, main_caller=main_caller)

    def trajectory(self, *, final_state: Any = None, stop_reason: str | None = None,
                   metadata: dict[str, Any] | None = None, main_caller: str | None = None) -> Trajectory:
        """The run as a trajectory: histories from the gateway's records, the final state attached.

        It waits for the records in the calling thread; async code should ``await fetch_trajectory(...)``.

        Calls cut short are kept with the tokens sampled before the cut (``finish_reason="cancelled"``);
        ``metadata["cancelled_calls"]`` counts them, when there are any. A call cut before its first token carries nothing to
        train on and is left out. Calls the gateway had received but not answered when the run ended (a synchronous
        node still waiting in its thread) have no record yet: ``metadata["unanswered_calls"]`` counts them.

        Args:
            final_state: what the run ended with (kept in memory on ``trajectory.final_state``).
            stop_reason: why the run stopped early (``"recursion_limit"``, ``"timeout"``, ``"max_turns"``...);
                the trajectory is then marked ``metadata["truncated"] = True``.
            metadata: more labels.
            main_caller: the caller the run ended with (an Agents SDK agent's name): its last call's history is
                the main one (``trajectory_from_records``); None: the history of the run's last call.

        Raises:
            NoTrainableCallsError: the run never called the trainable model (the message lists what it called),
                or its calls were sent but none of them sampled a token (the message says what happened to them:
                how many the gateway received and never answered, cut, refused).
        """
        if self.teacher is not None:
            return self._demonstration(final_state=final_state, stop_reason=stop_reason, metadata=metadata,
                                       main_caller=main_caller)
        records = self.model.rollout_records(self.rollout_id)
        status = self.model.rollout_status(self.rollout_id) if self._needs_status(records) else None
        return self._trajectory(records, status, final_state=final_state, stop_reason=stop_reason,
                                metadata=metadata, main_caller=main_caller)

    def _labels(self, stop_reason: str | None, metadata: dict[str, Any] | None) -> dict[str, Any]:
        labels: dict[str, Any] = {"framework": self.framework, "rollout_id": self.rollout_id,
                                  "truncated": stop_reason is not None}
        if stop_reason is not None:
            labels["stop_reason"] = stop_reason
        return {**labels, **(metadata or {})}

    def _demonstration(self, *, final_state: Any, stop_reason: str | None, metadata: dict[str, Any] | None,
                       main_caller: str | None) -> Trajectory:
        """The run as a demonstration: histories from the teacher's exchanges, no token ids."""
        assert self.teacher is not None
        exchanges = self.teacher.exchanges(self.rollout_id)
        if not exchanges:
            failures = self.teacher.failures(self.rollout_id)
            if failures:
                raise TeacherError(f"rollout {self.rollout_id}: the teacher answered none of its "
                                   f"{len(failures)} call(s); the last failure: {failures[-1]}")
            raise NoTrainableCallsError(self._why_never_called(stop_reason))
        labels = {**self._labels(stop_reason, metadata), DEMONSTRATION_KEY: True,
                  TEACHER_KEY: self.teacher.teacher.label}
        trajectory = trajectory_from_conversations(exchanges, id=self.trajectory_id, metadata=labels,
                                                   main_caller=main_caller)
        trajectory.metrics["teacher_calls"] = len(exchanges)
        trajectory.final_state = final_state
        for observer in self.observers:
            observer.link(trajectory)
        return trajectory

    def _needs_status(self, records: list[Any]) -> bool:
        """Whether building the trajectory needs the gateway's status: some call has no record (one more round
        trip on a remote backend, so it is asked only then)."""
        return (not any(r.completion_token_ids for r in records) or self.route.waiting_calls > 0
                or len({r.request_id for r in records}) < self.route.calls_maybe_recorded)

    def _trajectory(self, records: list[Any], status: RolloutStatus | None, *, final_state: Any,
                    stop_reason: str | None, metadata: dict[str, Any] | None, main_caller: str | None) -> Trajectory:
        sampled = [r for r in records if r.completion_token_ids]
        if not sampled:
            assert status is not None  # _needs_status asked for it
            raise NoTrainableCallsError(self._why_nothing_sampled(records, status, stop_reason))
        labels = self._labels(stop_reason, None)
        cancelled = sum(r.finish_reason == "cancelled" for r in records)
        if cancelled:
            labels["cancelled_calls"] = cancelled
        if status is not None and status.unanswered:
            labels["unanswered_calls"] = status.unanswered
        trajectory = trajectory_from_records(sampled, id=self.trajectory_id, metadata={**labels, **(metadata or {})},
                                             main_caller=main_caller)
        trajectory.final_state = final_state
        for observer in self.observers:
            observer.link(trajectory)
        return trajectory

    def _why_nothing_sampled(self, records: list[Any], status: RolloutStatus, stop_reason: str | None) -> str:
        """What became of the rollout's calls, as far as the scope and the gateway know (no guess at a cause)."""
        route = self.route
        if not records and not route.routed_calls and not status.unanswered:
            return self._why_never_called(stop_reason)
        recorded = len({r.request_id for r in records})
        cut = max(route.calls_to_record - recorded - status.unanswered, 0)
        parts = [f"{len(records)} recorded with no token sampled (cut before the first token)"] if records else []
        parts += [f"{status.unanswered} received by the gateway and never answered (still in flight when the rollout "
                  "ended)"] if status.unanswered else []
        parts += [f"{route.refused_calls} refused by the gateway with an error status"] if route.refused_calls else []
        parts += [f"{route.failed_calls} failed before any answer (connection errors)"] if route.failed_calls else []
        parts += [f"{cut} cut before the gateway recorded them"] if cut else []
        if status.unanswered:
            state = {"serving": "serving: they are queued for or being sampled by the engine",
                     "paused": "paused (a training step is running, or its checkpoint did not load): they wait for it",
                     "closed": "closed"}[status.gateway]
            ended = "the rollout's timeout ended the run" if stop_reason == "timeout" else "the run ended"
            advice = f"{ended} before the gateway answered them; the gateway is {state}"
        elif stop_reason == "timeout":
            advice = ("the rollout's timeout cut them: raise timeout=, or ask for fewer tokens per call "
                      "(max_tokens) so a call ends in time")
        elif route.refused_calls:
            advice = "the gateway's log and the agent's error say why it refused them"
        else:
            advice = "the run stopped before any of them sampled a token"
        sent = max(route.routed_calls, recorded + status.unanswered)
        return (f"rollout {self.rollout_id} sent {sent} call(s) to the trainable model, but none completed with a "
                f"sampled token: {'; '.join(parts) or 'none recorded'}. Nothing to train on: {advice}")

    def _why_never_called(self, stop_reason: str | None) -> str:
        seen = ", ".join(f"{name!r} ({count}x)" for name, count in self.route.models_seen.items())
        message = (f"rollout {self.rollout_id} never called the trainable model (routed names: "
                   f"{sorted(self.route.model_names)}); models named by calls made in the rollout's context: "
                   f"{seen or 'none'}. ")
        rename = ("Construct the agent's chat model with one of the routed names, or pass model_names=[...] naming "
                  "the one it uses")
        if stop_reason is not None:
            message += f"The run was stopped ({stop_reason}) before it made any call to the trainable model"
            if seen:
                return f"{message}. {rename}"
            if stop_reason == "timeout":
                message += (", or to any model. Synchronous graph nodes and tools run on the event loop's default "
                            "thread pool (min(32, cores + 4) threads): while blocked code holds all of them, the "
                            "next node waits for a thread")
            return message
        if seen:
            return message + rename
        return message + ("The run made no model call that could be seen. Either the path it took calls no model (a "
                          "run resumed after an interrupt whose remaining nodes are plain code, a branch without an "
                          "LLM node): a trajectory needs at least one call of the trainable model, so run such paths "
                          "outside the rollout or together with the call before them; or its calls were not seen: "
                          "calls made from a thread that does not copy the context (threading.Thread, or "
                          "executor.submit without contextvars.copy_context().run; asyncio.to_thread copies it) are "
                          "neither seen nor routed, nor are calls of an HTTP client other than httpx")

    def scored(self, trajectory: Trajectory) -> Trajectory:
        """The scored trajectory, its scores sent by the tracers."""
        for observer in self.observers:
            observer.finish(trajectory)
        return trajectory


def _with_callbacks(config: dict[str, Any], handlers: list[Any]) -> dict[str, Any]:
    """``config`` with ``handlers`` added to its callbacks (a list, or a callback manager, which is copied)."""
    callbacks = config.get("callbacks")
    if callbacks is None or isinstance(callbacks, list):
        return {**config, "callbacks": [*(callbacks or []), *handlers]}
    manager = callbacks.copy()
    for handler in handlers:
        manager.add_handler(handler, inherit=True)
    return {**config, "callbacks": manager}


async def score(trajectory: Trajectory, reward: RewardFn | None) -> Trajectory:
    """Set ``trajectory.reward`` from ``reward(trajectory, trajectory.final_state)`` (plain or async).

    A reward function that raises (or returns no finite number) does not end the group: the error goes to
    ``trajectory.logs`` and ``metadata["reward_error"]``, the reward stays as it was, and a warning is logged.
    """
    if reward is None:
        return trajectory
    try:
        trajectory.reward = await reward_value(reward, trajectory, trajectory.final_state)
    except Exception as exc:  # the user's code: record it on the trajectory, keep the group going
        message = f"{type(exc).__name__}: {exc}"
        logger.warning("reward function failed on trajectory %s: %s", trajectory.id, message)
        trajectory.logs.append(f"reward function raised {message}")
        trajectory.metadata["reward_error"] = message
    return trajectory


def check_seed(seed: Any) -> None:
    """Raise ``ConfigError`` unless ``seed`` is None or a whole number (a ``bool`` is not one)."""
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ConfigError(f"seed must be an int or None, got {type(seed).__name__} {seed!r}")


async def gather_group(n: int, rollout: Callable[[int | None], Awaitable[Trajectory]], *,
                       seed: int | None = None) -> TrajectoryGroup:
    """``n`` calls of ``rollout(seed_i)`` run concurrently, as one group for GRPO.

    ``seed_i`` is the i-th rollout's seed, derived from ``seed`` (so that the rollouts differ from each other
    and the group can be replayed), or None when ``seed`` is None.

    A rollout that fails is left out and listed in ``group.exceptions`` (and logged), not raised;
    ``KeyboardInterrupt`` and cancellation are not failures and propagate.
    """
    if n < 1:
        raise ConfigError(f"n is {n}: a group needs at least one rollout (GRPO needs two or more)")
    check_seed(seed)
    token = _group_id.set(uuid.uuid4().hex[:12])  # each rollout's task copies it (trace metadata: "group")
    try:
        results = await asyncio.gather(*(rollout(None if seed is None else derive_seed(seed, i)) for i in range(n)),
                                       return_exceptions=True)
    finally:
        _group_id.reset(token)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result
    errors = [_described(r) for r in results if isinstance(r, BaseException)]
    for message in errors:
        logger.warning("a rollout of the group failed: %s", message)
    return TrajectoryGroup([r for r in results if isinstance(r, Trajectory)], exceptions=errors)


def _described(error: BaseException) -> str:
    """``error`` as one entry of ``TrajectoryGroup.exceptions``: its type, message and notes (ours name unrouted
    models, LangGraph's the node that failed)."""
    return "\n".join([f"{type(error).__name__}: {error}", *getattr(error, "__notes__", ())])
