"""Train the model inside an unmodified OpenAI Agents SDK agent.

    from art_plugins.openai_agents import TrainableRunner

    runner = TrainableRunner(model)                     # model: a registered TrainableModel
    result, trajectory = await runner.run(agent, "What is 17*23?", reward=my_reward)
    group = await runner.group(agent, "What is 17*23?", n=8, reward=my_reward)   # 8 runs side by side
    await model.train([group])

``run`` takes ``Runner.run``'s arguments and returns its ``RunResult`` beside the run as a scored
trajectory; ``run_streamed`` is ``Runner.run_streamed`` (read ``stream_events()``, then
``await streamed.wait()``). To drive the SDK yourself, open ``runner.capture()`` and pass its
``run_config()`` to ``Runner.run``. A run the agent's own code starts during a run (a guardrail's checker
agent, a tool that runs an agent) takes ``run_config=current_run_config()`` to reach the trainable model too.

How the agent's calls reach the gateway, with the agent's code unchanged:

- **By model name.** An agent whose ``model=`` names the trainable model (``model.name``, or any of
  ``model_names``) is served from the rollout's gateway URL: the run's ``RunConfig`` carries a model
  provider (the SDK's public hook) that builds those models, and hands every other name to the provider
  the run would have used anyway. Only when an agent of the run (its handoffs and agents-as-tools
  included) built its own ``Model`` object (``OpenAIChatCompletionsModel(model=..., openai_client=...)``)
  is the HTTP redirect by name (``_routing.py``) installed for the run, since no provider is asked then. To put every agent of a run on the trainable
  model whatever its ``model=`` says, pass ``run_config=RunConfig(model=model.name)``, as with ``Runner.run``.
- **Either API.** The Responses API (the SDK's default) or chat completions (``set_default_openai_api``,
  or ``api="chat_completions"`` here), streamed or not: the gateway records both the same way.
- **Which agent called.** Every call is labelled with the calling agent's name (``CallRecord.caller``).
  The label is set by ``RunConfig.call_model_input_filter``, which the SDK runs in the task that makes the
  model call, just before it (``RunHooks.on_llm_start`` runs in a task of its own, where a context variable
  would not reach the request). After a handoff the next agent has its own instructions and tools, so its
  calls form another history of the same trajectory (``art_core.trajectories``).
- **No tracing.** Runs set ``RunConfig.tracing_disabled``: nothing is exported to OpenAI. With
  ``tracing=True`` tracing is left as the SDK is configured. Nothing global is changed either way.

How a run ends, and what the trajectory says:

- It finishes: ``(result, trajectory)``; ``trajectory.final_state`` is ``result.final_output`` (the reward
  function's second argument) and ``metadata["final_output"]`` keeps it as text.
- The SDK stops it over something the model did: too many turns (``MaxTurnsExceeded``), a call to a tool
  the agent does not have or output that does not parse (``ModelBehaviorError``), a refusal, a tripped
  guardrail. The trajectory is kept: ``(None, trajectory)``, marked ``metadata["truncated"]`` with
  ``metadata["stop_reason"]`` (``"max_turns"``, ``"model_behavior_error"``...) and the error in ``logs``;
  ``final_state`` is None. An ``error_handlers`` entry that turns the error into a final output gives a
  normal result, and the trajectory is marked all the same. A run cut by the runner's ``timeout`` (``run``
  and ``run_streamed``) is kept the same way (``"timeout"``), with the model call it cut recorded up to its
  last sampled token (``finish_reason="cancelled"``).
- A tool raises, or the model's arguments do not validate: by default the SDK tells the model and the run
  goes on. The trajectory's next call shows that message; ``logs`` keep the exception itself and
  ``metrics["tool_errors"]`` counts them (``RunConfig.tool_error_formatter`` reports them to us; a tool with
  its own ``failure_error_function`` handles its errors itself).
- Anything else (a network error, a tool whose ``failure_error_function=None`` lets its error through)
  raises, as from ``Runner.run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from contextvars import ContextVar, Token
from types import AsyncGeneratorType, TracebackType
from typing import Any, cast

import openai

from art_core import TrainableModel, Trajectory, TrajectoryGroup
from art_core.errors import ConfigError, LifecycleError

from ._langfuse_options import langfuse_tracers
from ._rollout import NoTrainableCallsError, RewardFn, RolloutScope, gather_group, score
from ._tracing import Tracer, rollout_tracers
from .demonstrations import Teacher

try:
    from agents import (
        Agent,
        RunConfig,
        RunErrorHandlers,
        RunHooks,
        Runner,
        RunResult,
        RunResultStreaming,
        RunState,
        Session,
        StreamEvent,
        TResponseInputItem,
    )
    from agents.run_config import DEFAULT_MAX_TURNS
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("art_plugins.openai_agents needs the OpenAI Agents SDK: pip install openai-agents") from exc

from ._agents_sdk import (  # noqa: E402  (after the SDK's own import check above)
    _HANDLED_STOP_REASONS,
    _KEPT_ERRORS,
    Api,
    _as_text,
    _builds_own_model,
    _calling_agent,
    _check_agent,
    _describe,
    _drain,
    _GatewayProvider,
    _labelling,
    _last_agent,
    _no_label,
    _note_outside_call,
    _noting,
    _reporting,
    _stop_reason,
)


__all__ = ["AgentCapture", "NoTrainableCallsError", "StreamedRun", "TrainableRunner", "current_run_config"]

logger = logging.getLogger(__name__)

RunInput = str | list[TResponseInputItem] | RunState[Any]
"""What ``Runner.run`` takes as ``input``: a user message, input items, or a paused run's state."""

_current_capture: ContextVar[AgentCapture | None] = ContextVar("art_plugins_current_capture", default=None)


def current_run_config(base: RunConfig | dict[str, Any] | None = None) -> RunConfig | dict[str, Any] | None:
    """The ``run_config`` for a run that an agent's own code starts inside a captured run, or ``base`` outside one.

    The SDK hands a run's ``RunConfig`` to nothing the run's tools or guardrails start themselves: a guardrail
    that checks the input with an agent of its own (``await Runner.run(checker, input)``, as the SDK's guardrail
    docs show) or a tool that runs one would reach its model through the SDK's default provider, not the trainable
    model (no API key: an error; a real key and a name in ``model_names``: a silent call to OpenAI, untrained).
    Pass this instead: ``await Runner.run(checker, input, run_config=current_run_config())``. Inside a run of
    ``TrainableRunner`` (or a ``capture()``) the nested run's calls to the trainable model go to the rollout's
    gateway and join the trajectory as another history (caller: the nested agent's name); anywhere else it
    returns ``base`` unchanged (None: ``Runner.run``'s default), so the agent runs as before outside training.

    Args:
        base: the nested run's own configuration. Default: ``RunConfig()``.
    """
    capture = _current_capture.get()
    return base if capture is None else capture.run_config(base)


class TrainableRunner:
    """Runs Agents SDK agents with ``model`` in place of the model they name, capturing each run as a trajectory.

    Args:
        model: the registered ``TrainableModel``.
        model_names: the model names the agents use for the trainable model (besides ``model.name``, which
            always means it). Default: none. An agent with no ``model=`` uses the SDK's default model
            (``agents.models.get_default_model()``): list that name to train in its place.
        api: ``"responses"`` or ``"chat_completions"`` for the trainable model. Default: the SDK's default
            API (``set_default_openai_api``), as ``Runner.run`` would use.
        tracing: False (default) disables the SDK's tracing for these runs, so nothing is exported to
            OpenAI; True leaves tracing as the SDK is configured.
        timeout: seconds per ``run`` or ``run_streamed``; a run that exceeds it is cancelled and kept, marked
            truncated (``stop_reason="timeout"``), the call it cut recorded up to its last sampled token.
            Default: no limit.
        langfuse: True (keys from ``LANGFUSE_*``), a ``langfuse.Langfuse`` client or an
            ``art_plugins.langfuse.LangfuseTracing``: each ``run`` (and each run of ``group``) becomes a Langfuse
            trace with the SDK's structure, rewards scores, steps traces (see ``art_plugins.langfuse``; those
            runs are traced, whatever ``tracing`` says); ``run_streamed`` too, its trace ending with its
            events. Default: off.

    Raises:
        ConfigError: an argument is invalid (the message says which).
    """

    def __init__(self, model: TrainableModel, *, model_names: Iterable[str] | None = None, api: Api | None = None,
                 tracing: bool = False, timeout: float | None = None, langfuse: Any = None) -> None:
        if not isinstance(model, TrainableModel):
            raise ConfigError(f"TrainableRunner needs a TrainableModel, got {type(model).__name__}")
        names = frozenset(model_names or ())
        if not all(isinstance(n, str) and n for n in names):
            raise ConfigError(f"model_names must be non-empty strings, got {sorted(map(repr, names))}")
        if api not in (None, "responses", "chat_completions"):
            raise ConfigError(f"api is {api!r}: use 'responses', 'chat_completions', or None for the SDK's default")
        if timeout is not None and not timeout > 0:
            raise ConfigError(f"timeout is {timeout}: give a positive number of seconds, or None for no limit")
        self.model = model
        self.model_names = names | {model.name}
        self.api = api
        self.tracing = tracing
        self.timeout = timeout
        self.langfuse = langfuse
        # What traces each run (``art_plugins._tracing``): Langfuse when ``langfuse`` turns it on.
        self._tracers: tuple[Tracer, ...] = langfuse_tracers(langfuse, model)
        self._teacher: Any = None  # the TeacherProxy, on the copy demonstrations() yields

    def __repr__(self) -> str:
        return f"TrainableRunner(model={self.model.name!r}, model_names={sorted(self.model_names)})"

    def demonstrations(self, teacher: Teacher | str) -> contextlib.AbstractAsyncContextManager[TrainableRunner]:
        """Demonstration mode: ``async with runner.demonstrations(teacher) as demo:`` gives a ``TrainableRunner``
        whose runs (``run``, ``run_streamed``, ``group``, ``capture``, either API) have the trainable model's calls
        answered by ``teacher`` instead of the gateway; each trajectory holds the teacher's turns for
        ``model.train_sft`` (see ``art_plugins.demonstrations``). ``teacher``: a ``Teacher`` or a litellm model
        string. A teacher that fails a call raises ``TeacherError`` from the run, quoting it.
        """
        from ._teacher_proxy import demonstrating

        return demonstrating(self, teacher)

    def capture(self, *, rollout_id: str | None = None, agent: Agent[Any] | None = None,
                run_config: RunConfig | dict[str, Any] | None = None, seed: int | None = None) -> AgentCapture:
        """A scope (``async with``) for driving the SDK yourself; see ``AgentCapture``.

        Args:
            rollout_id: default: a new random id.
            seed: seeds the run's sampling (see ``run``). Default: unseeded.
            agent, run_config: what the run will use, when known: the HTTP redirect is installed only if one
                of its agents built its own ``Model`` object. Default: unknown, so the redirect is installed.
        """
        redirect = agent is None or _builds_own_model(agent, run_config)
        return AgentCapture(self, rollout_id=rollout_id, redirect=redirect, seed=seed)

    def _traced_capture(self, input: Any, *, rollout_id: str | None, agent: Agent[Any],
                        run_config: RunConfig | dict[str, Any] | None, seed: int | None) -> AgentCapture:
        """``capture`` for a run this runner makes, traced by its tracers (none when tracing is off)."""
        return AgentCapture(self, rollout_id=rollout_id, redirect=_builds_own_model(agent, run_config), seed=seed,
                            tracers=rollout_tracers(self._tracers), input=input)

    async def run(self, starting_agent: Agent[Any], input: RunInput, *, reward: RewardFn | None = None,
                  context: Any = None, max_turns: int | None = DEFAULT_MAX_TURNS, hooks: RunHooks[Any] | None = None,
                  run_config: RunConfig | dict[str, Any] | None = None,
                  error_handlers: RunErrorHandlers[Any] | None = None, session: Session | None = None,
                  rollout_id: str | None = None, seed: int | None = None) -> tuple[RunResult | None, Trajectory]:
        """``Runner.run`` with the trainable model, returning the SDK's result and the run as a scored trajectory.

        Args:
            starting_agent, input, context, max_turns, hooks, run_config, error_handlers, session: as for
                ``Runner.run`` (``previous_response_id`` and ``conversation_id`` are left out: the gateway
                stores no conversations).
            reward: ``reward(trajectory, final_output) -> float``, plain or async. If it raises, the error is
                recorded on the trajectory (``logs``, ``metadata["reward_error"]``) and the reward stays 0.
            rollout_id: default: a new random id.
            seed: seeds the sampling: the run's k-th call to the trainable model is sampled with a seed derived
                from ``seed`` and k, so a run whose calls come in a fixed order (no parallel agents) samples the
                same tokens again with the same seed and adapter. Default: unseeded.

        Returns:
            ``(result, trajectory)``; ``result`` is None when the SDK stopped the run over the model's
            behaviour (the trajectory says why; see the module docstring).

        Raises:
            NoTrainableCallsError: the run never called the trainable model (the message lists what it called).
            Exception: what ``Runner.run`` raises, except the errors that end a run over the model's behaviour
                (re-raised too when the run stopped before any trainable call).
        """
        _check_agent(starting_agent)
        capture = self._traced_capture(input, rollout_id=rollout_id, agent=starting_agent, run_config=run_config,
                                       seed=seed)
        result: RunResult | None = None
        error: BaseException | None = None
        deadline = asyncio.timeout(self.timeout)
        async with capture:
            config, handlers = capture.run_config(run_config), capture.error_handlers(error_handlers)
            try:
                async with deadline:
                    result = await Runner.run(starting_agent, input, context=context, max_turns=max_turns, hooks=hooks,
                                              run_config=config, error_handlers=handlers, session=session)
            except _KEPT_ERRORS as exc:
                error = exc
            except TimeoutError as exc:
                if not deadline.expired():
                    raise  # the agent's own timeout, not ours
                error = exc
            except Exception as exc:
                _note_outside_call(exc, self.model, nested_config_taken=capture.nested_config_taken)
                raise
        if error is not None:
            # A call the error cut (our timeout, a guardrail that tripped mid-call) is recorded once the gateway
            # sees the client go: wait for it before asking whether the run made any call.
            await capture.scope.settle()
            if not isinstance(error, TimeoutError) and not await capture.fetch_made_calls():
                raise error
        last_agent = result.last_agent if result is not None else _last_agent(error)
        trajectory = await capture.fetch_trajectory(final_output=result.final_output if result is not None else None,
                                                    last_agent=last_agent, error=error,
                                                    interruptions=_interruptions(result))
        return result, capture.scope.scored(await score(trajectory, reward))

    def run_streamed(self, starting_agent: Agent[Any], input: RunInput, *, reward: RewardFn | None = None,
                     context: Any = None, max_turns: int | None = DEFAULT_MAX_TURNS,
                     hooks: RunHooks[Any] | None = None, run_config: RunConfig | dict[str, Any] | None = None,
                     error_handlers: RunErrorHandlers[Any] | None = None, session: Session | None = None,
                     rollout_id: str | None = None, seed: int | None = None) -> StreamedRun:
        """``Runner.run_streamed`` with the trainable model (call it with an event loop running).

        Read ``stream_events()`` to the end (or ``await streamed.wait()``), then ``streamed.trajectory`` holds
        the scored run. Arguments (``seed`` too) and endings are those of ``run``, ``timeout`` included (the run is cancelled
        when it runs out: the events end, and the trajectory says ``stop_reason="timeout"``). Cancelling it
        yourself (``streamed.result.cancel()``) marks it ``stop_reason="cancelled"``.
        """
        _check_agent(starting_agent)
        capture = self._traced_capture(input, rollout_id=rollout_id, agent=starting_agent, run_config=run_config,
                                       seed=seed)
        capture.scope.hold()  # the run's task carries the route and the traces on; the stream's end releases them
        try:
            # The SDK starts the run in a task of its own, which copies the current context: the route set
            # here goes with it, while the caller's own context is left as it was when this returns.
            config, handlers = capture.run_config(run_config), capture.error_handlers(error_handlers)
            with capture.scope, _no_label():
                result = Runner.run_streamed(starting_agent, input, context=context, max_turns=max_turns, hooks=hooks,
                                             run_config=config, error_handlers=handlers, session=session)
        except BaseException:
            capture.scope.release()
            raise
        return StreamedRun(capture, result, reward, timeout=self.timeout)

    async def group(self, starting_agent: Agent[Any], input: RunInput, *, n: int,
                    reward: RewardFn | None = None, context: Any = None, max_turns: int | None = DEFAULT_MAX_TURNS,
                    hooks: RunHooks[Any] | None = None, run_config: RunConfig | dict[str, Any] | None = None,
                    error_handlers: RunErrorHandlers[Any] | None = None, seed: int | None = None) -> TrajectoryGroup:
        """``n`` runs of the same input, concurrently, as one group for GRPO.

        Every run gets the same ``context`` object (give it no state the runs would share by accident). A run
        that fails is left out and listed in ``group.exceptions``, not raised. ``seed`` seeds the group: each run
        gets its own seed derived from it (see ``run``), so the runs differ and the group can be sampled again.
        """
        async def one(run_seed: int | None) -> Trajectory:
            _, trajectory = await self.run(starting_agent, input, reward=reward, context=context, max_turns=max_turns,
                                           hooks=hooks, run_config=run_config, error_handlers=error_handlers,
                                           seed=run_seed)
            return trajectory

        return await gather_group(n, one, seed=seed)

    def rollout_fn(self, *, reward: RewardFn | None = None,
                   agent: Agent[Any] | None = None) -> Callable[[Any], Awaitable[Trajectory]]:
        """A function that runs ``agent`` once on an input and returns the run as a scored trajectory.

        The method both adapters share (``TrainableGraph.rollout_fn`` takes the same arguments), for code that
        runs either one over a list of inputs, such as ``art_plugins.langfuse.evaluate``. The function takes what
        ``run`` takes as ``input`` (a user message, or input items).

        Args:
            reward: as for ``run``.
            agent: the starting agent.

        Raises:
            ConfigError: no agent was given.
        """
        if agent is None:
            raise ConfigError("TrainableRunner.rollout_fn needs agent=<the starting agent> (evaluate() on a "
                              "TrainableRunner: pass agent=...)")
        _check_agent(agent)

        async def run(input: Any) -> Trajectory:
            _, trajectory = await self.run(agent, input, reward=reward)
            return trajectory
        return run


class AgentCapture:
    """One captured run: routing to the gateway, the ``RunConfig`` that points the SDK there, what the run reported.

    ``TrainableRunner.run`` uses one per run; use one yourself to call the SDK directly:

        async with runner.capture() as run:
            result = await Runner.run(agent, "Hi!", run_config=run.run_config())
        trajectory = await run.fetch_trajectory(final_output=result.final_output, last_agent=result.last_agent)

    The capture itself is opened with ``async with`` only; a synchronous run (``Runner.run_sync`` in a worker
    thread, started inside it) is captured too, and ``run.trajectory(...)`` is ``fetch_trajectory`` waited for in
    the calling thread (never on the event loop that serves a ``LocalBackend``'s gateway).

    Attributes:
        rollout_id: the gateway's rollout id for this run's calls.
        scope: the underlying ``RolloutScope`` (routing by model name, records).
        tool_errors: one line per tool error the SDK reported to the model.
    """

    def __init__(self, runner: TrainableRunner, *, rollout_id: str | None = None, redirect: bool = True,
                 seed: int | None = None, tracers: tuple[Tracer, ...] = (), input: Any = None) -> None:
        self._runner = runner
        self.scope = RolloutScope(runner.model, model_names=runner.model_names, framework="openai-agents",
                                  caller=_calling_agent.get, rollout_id=rollout_id, redirect=redirect, seed=seed,
                                  tracers=tracers, input=input, teacher=runner._teacher)
        self.rollout_id = self.scope.rollout_id
        self.tool_errors: list[str] = []
        self._handled_stop: str | None = None
        self._providers: list[_GatewayProvider] = []
        self._label_token: Token[str | None] | None = None
        self._capture_token: Token[AgentCapture | None] | None = None

    async def __aenter__(self) -> AgentCapture:
        self.scope.__enter__()
        self._label_token = _calling_agent.set(None)
        self._capture_token = _current_capture.set(self)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._label_token is not None:
            _calling_agent.reset(self._label_token)
            self._label_token = None
        if self._capture_token is not None:
            _current_capture.reset(self._capture_token)
            self._capture_token = None
        if exc is not None:
            self._explain(exc)
        await self.scope.__aexit__(exc_type, exc, tb)
        await self._close_providers()

    def _explain(self, error: BaseException) -> None:
        """Note on an OpenAI error raised inside the scope where the call most likely went instead of the gateway."""
        if not isinstance(error, openai.OpenAIError) or any(
                note.startswith("art-plugins:") for note in getattr(error, "__notes__", ())):
            return  # not an OpenAI error, or explained already (runner.run notes its own)
        if self._providers:  # the run had our RunConfig: an agent started outside it (a guardrail's checker)
            _note_outside_call(error, self.scope.model, nested_config_taken=self.nested_config_taken)
        else:
            error.add_note("art-plugins: no Runner.run inside this runner.capture() scope took its RunConfig, so the "
                           "SDK called its default client (hence an OpenAI error: a missing key, a model only the "
                           "gateway serves). Pass run_config=run.run_config() to Runner.run / Runner.run_streamed "
                           "inside the scope (or use runner.run(...), which does it).")

    @property
    def nested_config_taken(self) -> bool:
        """Whether a run beside the captured one took this scope's ``RunConfig`` (``current_run_config()``): the
        scope gave out more than one."""
        return len(self._providers) > 1

    def run_config(self, base: RunConfig | dict[str, Any] | None = None) -> RunConfig:
        """``base`` (default: ``RunConfig()``) with the trainable model's provider, call labels, tool-error
        reports, and tracing off unless the runner was made with ``tracing=True``."""
        if base is None or isinstance(base, dict):
            config = RunConfig(**(base or {}))
            owns_provider = base is None or "model_provider" not in base  # Runner.run would have owned it
        elif isinstance(base, RunConfig):
            config, owns_provider = base, False
        else:
            raise ConfigError(f"run_config must be a RunConfig or a dict, got {type(base).__name__}")
        runner = self._runner
        provider = _GatewayProvider(runner.model, rollout_id=self.rollout_id, names=runner.model_names,
                                    api=runner.api, fallback=config.model_provider, owns_fallback=owns_provider,
                                    route=self.scope.route)
        self._providers.append(provider)
        return dataclasses.replace(
            config, model_provider=provider,
            call_model_input_filter=_labelling(config.call_model_input_filter),
            tool_error_formatter=_reporting(config.tool_error_formatter, self.tool_errors),
            # A traced run needs the SDK's tracing on: tracers read the SDK's spans (OpenInference for Langfuse).
            tracing_disabled=config.tracing_disabled or not (runner.tracing or self.scope.traced),
        )

    def error_handlers(self, handlers: RunErrorHandlers[Any] | None) -> RunErrorHandlers[Any] | None:
        """The run's ``error_handlers``, each noting on this capture when it turned an error into a final output."""
        if not handlers:
            return handlers
        given = cast(dict[str, Callable[[Any], Any]], handlers)
        noted = {kind: _noting(kind, handler, self._note_handled) for kind, handler in given.items()}
        return cast("RunErrorHandlers[Any]", noted)

    def _note_handled(self, kind: str) -> None:
        """An ``error_handlers`` entry turned an error of ``kind`` into a final output: the run did stop early."""
        self._handled_stop = _HANDLED_STOP_REASONS.get(kind, kind)

    def made_calls(self) -> bool:
        """Whether any call of this run was recorded (waited for in this thread; see ``fetch_made_calls``)."""
        return self.scope.made_calls()

    async def fetch_made_calls(self) -> bool:
        """``made_calls``, without blocking the event loop."""
        return await self.scope.fetch_made_calls()

    async def fetch_trajectory(self, *, final_output: Any = None, last_agent: Agent[Any] | None = None,
                               error: BaseException | None = None, stop_reason: str | None = None,
                               interruptions: Iterable[Any] = ()) -> Trajectory:
        """``trajectory``, with the gateway's records fetched without blocking the event loop."""
        stop_reason, metadata = self._labels(final_output, last_agent, error, stop_reason, interruptions)
        trajectory = await self.scope.fetch_trajectory(final_state=final_output, stop_reason=stop_reason,
                                                       metadata=metadata, main_caller=metadata.get("last_agent"))
        return self._reported(trajectory, error, metadata)

    def trajectory(self, *, final_output: Any = None, last_agent: Agent[Any] | None = None,
                   error: BaseException | None = None, stop_reason: str | None = None,
                   interruptions: Iterable[Any] = ()) -> Trajectory:
        """The run as a trajectory (not yet scored): histories from the gateway's records, and what the run reported.

        It waits for the records in the calling thread; async code should ``await fetch_trajectory(...)``.

        Args:
            final_output: the run's final output (``trajectory.final_state``; also ``metadata["final_output"]``).
            last_agent: the agent the run ended with (``metadata["last_agent"]``): its history is the main one.
            error: the SDK error that stopped the run, if any: it sets the stop reason and goes to ``logs``.
            stop_reason: why the run stopped early, when ``error`` does not say (e.g. ``"cancelled"``).
            interruptions: the result's ``interruptions`` (tool calls waiting for a human's approval): the run is
                paused, not finished, and says so (``stop_reason="interrupted"``; ``metadata["interruptions"]``: the
                waiting tools' names, comma-separated).

        Raises:
            NoTrainableCallsError: the run never called the trainable model.
        """
        stop_reason, metadata = self._labels(final_output, last_agent, error, stop_reason, interruptions)
        # The run's own agent's history is the main one, even when a guardrail's checker called after it.
        trajectory = self.scope.trajectory(final_state=final_output, stop_reason=stop_reason, metadata=metadata,
                                           main_caller=metadata.get("last_agent"))
        return self._reported(trajectory, error, metadata)

    def _labels(self, final_output: Any, last_agent: Agent[Any] | None, error: BaseException | None,
                stop_reason: str | None, interruptions: Iterable[Any] = ()) -> tuple[str | None, dict[str, Any]]:
        stop_reason = _stop_reason(error) if error is not None else stop_reason or self._handled_stop
        metadata: dict[str, Any] = {"final_output": _as_text(final_output)}
        pending = list(interruptions)
        if pending and error is None:  # paused for a human's approval (needs_approval tools)
            stop_reason = stop_reason or "interrupted"
            metadata["interruptions"] = ", ".join(str(getattr(item, "tool_name", None) or type(item).__name__)
                                                  for item in pending)  # the tools waiting, by name
        if last_agent is not None:
            metadata["last_agent"] = last_agent.name
        if error is not None:
            metadata["error"] = _describe(error, self._runner.timeout)
        return stop_reason, metadata

    def _reported(self, trajectory: Trajectory, error: BaseException | None, metadata: dict[str, Any]) -> Trajectory:
        trajectory.logs.extend(self.tool_errors)
        if error is not None:
            trajectory.logs.append(f"run stopped: {metadata['error']}")
            if "last_agent" not in trajectory.metadata and trajectory.calls and trajectory.calls[-1].caller:
                # an SDK error without run_data (output that does not parse): the agent of the run's last call
                trajectory.metadata["last_agent"] = trajectory.calls[-1].caller
        trajectory.metrics["tool_errors"] = len(self.tool_errors)
        return trajectory

    # --- for streamed runs, whose task outlives the ``with`` that starts it ---

    async def _aclose(self) -> None:
        """End what the scope held for the run (the routing wrappers, its traces); close its gateway clients."""
        await self.scope.counted()
        self.scope.release()
        await self._close_providers()

    # --- helpers ---

    async def _close_providers(self) -> None:
        providers, self._providers = self._providers, []
        for provider in providers:
            await provider.aclose()


class StreamedRun:
    """A streamed run: the SDK's events while it runs, then the run as a scored trajectory.

        streamed = runner.run_streamed(agent, "Weather in Paris?", reward=my_reward)
        async for event in streamed.stream_events():     # the SDK's StreamEvents
            ...
        result, trajectory = await streamed.wait()

    Attributes:
        result: the SDK's ``RunResultStreaming`` (``final_output``, ``new_items``, ``cancel()``...).
    """

    def __init__(self, capture: AgentCapture, result: RunResultStreaming, reward: RewardFn | None, *,
                 timeout: float | None = None) -> None:
        self.result = result
        self._capture = capture
        self._reward = reward
        self._timeout = timeout
        self._timed_out = False
        # The SDK's run task is already going: the limit counts from now, as Runner.run's does.
        self._timer = (asyncio.get_running_loop().call_later(timeout, self._time_out)
                       if timeout is not None else None)
        self._events: AsyncGeneratorType[StreamEvent, None] | None = None
        self._started = False  # the events' generator has begun running
        self._done = asyncio.Event()
        self._trajectory: Trajectory | None = None
        self._failure: BaseException | None = None

    @property
    def rollout_id(self) -> str:
        return self._capture.rollout_id

    @property
    def trajectory(self) -> Trajectory:
        """The scored run, once the stream has ended.

        Raises:
            LifecycleError: the stream has not ended yet, or ended with an error.
        """
        if self._trajectory is None:
            raise LifecycleError("the streamed run has not ended: read stream_events() to the end or await wait() "
                                 "first" if self._failure is None else
                                 f"the streamed run failed ({type(self._failure).__name__}: {self._failure}): "
                                 "it has no trajectory")
        return self._trajectory

    def stream_events(self) -> AsyncIterator[StreamEvent]:
        """The SDK's events (``RunResultStreaming.stream_events()``); at their end the trajectory is built and scored.

        The SDK's errors that end a run over the model's behaviour end the stream instead of being raised
        (see the module docstring); other errors are raised. Stopping early is fine: the SDK finishes the run
        anyway, ``wait()`` reads the rest, and the trajectory holds all of it.

        Raises:
            LifecycleError: the events were asked for already (they can be read once).
        """
        if self._events is not None:
            raise LifecycleError("stream_events() was already called on this run: its events can be read once")
        self._events = cast("AsyncGeneratorType[StreamEvent, None]", self._stream())
        return self._events

    async def wait(self) -> tuple[RunResultStreaming, Trajectory]:
        """Wait for the run's end, then return ``(result, trajectory)``.

        Call it instead of reading the events (it reads them), or after the reading loop, finished or not.

        Raises:
            Exception: what ``stream_events()`` raised.
        """
        if self._events is None or not self._started:
            async for _ in self._events or self.stream_events():
                pass
        elif not self._done.is_set() and not self._events.ag_running:
            await self._events.aclose()  # the reader stopped early: closing its stream lets the run end
        await self._done.wait()
        if self._failure is not None:
            raise self._failure
        return self.result, self.trajectory

    async def _stream(self) -> AsyncGenerator[StreamEvent, None]:
        self._started = True
        sdk_events = cast(AsyncGenerator[StreamEvent, None], self.result.stream_events())
        error: BaseException | None = None
        try:
            async with contextlib.aclosing(sdk_events):
                try:
                    async for event in sdk_events:
                        yield event
                except GeneratorExit:
                    # The reader stopped early. The run goes on to its end anyway: read the rest here, so that
                    # its end (an output, or the error that stopped it) is found as if the reader had seen it.
                    await self._finish(await _drain(sdk_events))
                    raise
        except _KEPT_ERRORS as exc:
            error = exc
        except GeneratorExit:
            raise
        except BaseException as exc:
            self._failure = self._capture.scope.explained(exc)  # a teacher's failure, in demonstration mode
            _note_outside_call(self._failure, self._capture.scope.model,
                               nested_config_taken=self._capture.nested_config_taken)
            self._done.set()
            await self._capture._aclose()
            if self._failure is not exc:
                raise self._failure from exc
            raise
        await self._finish(error)

    def _time_out(self) -> None:
        """The run took longer than ``timeout``: cancel it (its events then end, and ``_finish`` marks it)."""
        if not self.result.is_complete:
            self._timed_out = True
            self.result.cancel()

    async def _finish(self, error: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        try:
            await self._capture._aclose()
            if self._timed_out and error is None:
                error = TimeoutError(f"the run took longer than timeout={self._timeout} s")
            result = self.result
            final_output = result.final_output if error is None else None
            pending = _interruptions(result)
            # cancel(): the run ended without an output (a run paused for an approval has none either)
            cancelled = error is None and final_output is None and not pending
            if error is not None or cancelled:
                # a call the error or cancel() cut is recorded once the gateway sees the cut: wait for it
                await self._capture.scope.settle()
                if (error is not None and not isinstance(error, TimeoutError)
                        and not await self._capture.fetch_made_calls()):
                    raise error
            trajectory = await self._capture.fetch_trajectory(
                final_output=final_output, last_agent=result.last_agent, error=error,
                stop_reason="cancelled" if cancelled else None, interruptions=pending)
            self._trajectory = self._capture.scope.scored(await score(trajectory, self._reward))
        except BaseException as exc:
            self._failure = exc
            raise
        finally:
            self._done.set()


def _interruptions(result: Any) -> list[Any]:
    """A run result's pending approvals (``interruptions``; none on SDKs before human-in-the-loop)."""
    return list(getattr(result, "interruptions", None) or []) if result is not None else []
