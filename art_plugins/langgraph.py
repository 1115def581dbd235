"""Train the model inside an unmodified LangGraph graph.

    from art_plugins.langgraph import trainable

    agent = trainable(graph, model)                     # graph: any compiled LangGraph graph
    trajectory = await agent.rollout({"messages": [("user", "What is 17*23?")]}, reward=my_reward)
    group = await agent.group(task_input, n=8, reward=my_reward)   # 8 rollouts side by side
    await model.train([group])

The graph's nodes build their chat models as usual (``ChatOpenAI(model="agent")``,
``init_chat_model("openai:agent")``). While a rollout runs, requests naming the trainable model go to the
gateway under the rollout's id; every other model (a judge, a hosted model in another node) is called
as before. Each routed call is labelled with the LangGraph node that made it (its path from the root graph:
``researcher/agent`` inside a subgraph).

``rollout`` runs the graph with ``astream`` by default (so a run stopped by its step or time limit keeps
its last state); ``method="ainvoke"``, ``"invoke"`` or ``"astream_events"`` run it those ways. To drive
the graph yourself, open the scope: ``with agent.capture() as run: graph.invoke(...)``, then
``run.trajectory(final_state=...)`` (call the sync API from a thread, never from the event loop that serves a
``LocalBackend``'s gateway: blocked, it could not answer, so a call to the trainable model made there is refused
at once with a ``ConfigError``). In async code, ``async with agent.capture() as run: await graph.ainvoke(...)``, then
``await run.fetch_trajectory(final_state=...)``: the records are fetched without blocking the loop.

Synchronous nodes (``def work(state)``) are fine, in any number: under ``astream``/``ainvoke`` LangGraph runs
them on the event loop's default thread pool, where each holds its thread until the model answers, and the
engine, gateway and training step never need a thread of that pool (``art_core._threads``); nodes beyond the
pool's size wait for a thread. ``method="invoke"`` runs each rollout in a thread of its own (its nodes then
run on LangGraph's own per-run pool), so a group never queues behind itself.

``async with agent.demonstrations(teacher) as demo:`` gives the same graph with its trainable calls answered by a
stronger model, its rollouts demonstrations for supervised fine-tuning (``art_plugins.demonstrations``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import threading
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from art_core import TrainableModel, Trajectory, TrajectoryGroup
from art_core.errors import ConfigError

from ._langfuse_options import langfuse_tracers
from ._rollout import NoTrainableCallsError, RewardFn, RolloutScope, gather_group, score
from ._tracing import Tracer, rollout_tracers
from .demonstrations import Teacher

if TYPE_CHECKING:
    from ._teacher_proxy import TeacherProxy

__all__ = ["NoTrainableCallsError", "TrainableGraph", "trainable"]

Method = Literal["astream", "ainvoke", "invoke", "astream_events"]
_METHODS = ("astream", "ainvoke", "invoke", "astream_events")
G = TypeVar("G")


def _current_node() -> str | None:
    """The LangGraph node running the current call, as its path from the root graph: ``"agent"`` for a node of the
    graph itself, ``"researcher/agent"`` for node ``agent`` of a subgraph run by node ``researcher`` (two sub-agents
    built alike are told apart). LangChain keeps the node's config in a context variable; its checkpoint namespace,
    ``"researcher:<task id>|agent:<task id>"``, holds the path."""
    from langchain_core.runnables.config import var_child_runnable_config

    config = var_child_runnable_config.get()
    if not config:
        return None
    metadata = config.get("metadata") or {}
    if "langgraph_node" not in metadata:
        # A chain run with metadata of its own (``chain.invoke(x, config={"metadata": ...})``, as LangChain's
        # summarisation middleware does) replaces the node's; its callbacks still carry it, inherited.
        inherited = getattr(config.get("callbacks"), "inheritable_metadata", None) or {}
        metadata = {**inherited, **metadata}
    node = metadata.get("langgraph_node")
    if node is None:
        return None
    namespace = metadata.get("langgraph_checkpoint_ns")
    path = [part.rpartition(":")[0] or part for part in str(namespace).split("|")] if namespace else []
    if not path or path[-1] != str(node):  # a namespace not of the shape above: the node alone
        return str(node)
    return "/".join(path)


class TrainableGraph:
    """A compiled graph whose calls to ``model`` are captured as trajectories.

    Args:
        graph: a compiled LangGraph graph (anything with ``ainvoke``/``astream``).
        model: the registered ``TrainableModel``.
        model_names: the model names the graph's chat models use for the trainable model. Default: ``model.name``.
        recursion_limit: LangGraph's step limit per run; a run that reaches it is kept, marked truncated.
        timeout: seconds per run; a run that exceeds it is cancelled and kept, marked truncated
            (``stop_reason="timeout"``), with the call it cut recorded up to the last token sampled.
        langfuse: True (keys from ``LANGFUSE_*``), a ``langfuse.Langfuse`` client or an
            ``art_plugins.langfuse.LangfuseTracing``: each rollout becomes a Langfuse trace, rewards scores,
            steps traces (see ``art_plugins.langfuse``). Default: off, nothing imported or sent.
    """

    def __init__(self, graph: Any, model: TrainableModel, *, model_names: Iterable[str] | None = None,
                 recursion_limit: int | None = None, timeout: float | None = None, langfuse: Any = None) -> None:
        if not hasattr(graph, "astream") or not hasattr(graph, "ainvoke"):
            raise ConfigError(f"trainable() needs a compiled LangGraph graph, got {type(graph).__name__}: call "
                              ".compile() on a StateGraph first")
        if not isinstance(model, TrainableModel):
            raise ConfigError(f"trainable() needs a TrainableModel, got {type(model).__name__}")
        self.graph = graph
        self.model = model
        self.model_names = frozenset(model_names) if model_names is not None else frozenset({model.name})
        self.recursion_limit = recursion_limit
        self.timeout = timeout
        self.langfuse = langfuse
        # What traces each rollout (``art_plugins._tracing``): Langfuse when ``langfuse`` turns it on.
        self._tracers: tuple[Tracer, ...] = langfuse_tracers(langfuse, model)
        self._teacher: TeacherProxy | None = None  # set on the copy demonstrations() yields

    def __repr__(self) -> str:
        return f"TrainableGraph({type(self.graph).__name__}, model={self.model.name!r})"

    def demonstrations(self, teacher: Teacher | str) -> AbstractAsyncContextManager[TrainableGraph]:
        """Demonstration mode: ``async with agent.demonstrations(teacher) as demo:`` gives a ``TrainableGraph``
        whose rollouts (``rollout``, ``group``, ``capture``, ``rollout_fn``) have the graph's calls to the
        trainable model answered by ``teacher`` instead of the gateway, unchanged otherwise; each trajectory holds
        the teacher's turns for ``model.train_sft`` (see ``art_plugins.demonstrations``).

        Args:
            teacher: a ``Teacher`` (an OpenAI-compatible server, or a litellm model), or a litellm model string.

        Raises:
            ConfigError: ``teacher`` is neither.
            TeacherError: (from the rollouts) the teacher was unreachable or answered a call with an error.
        """
        from ._teacher_proxy import demonstrating

        return demonstrating(self, teacher)

    def capture(self, *, rollout_id: str | None = None, seed: int | None = None) -> RolloutScope:
        """A scope (``with`` or ``async with``) in which the graph's trainable calls are captured.

        Args:
            rollout_id: default: a new random id.
            seed: seeds the run's sampling (see ``rollout``). Default: unseeded.
        """
        return self._scope(rollout_id=rollout_id, seed=seed)

    def _scope(self, *, rollout_id: str | None, seed: int | None, tracers: tuple[Tracer, ...] = (),
               input: Any = None) -> RolloutScope:
        return RolloutScope(self.model, model_names=self.model_names, framework="langgraph", caller=_current_node,
                            rollout_id=rollout_id, seed=seed, tracers=tracers, input=input, teacher=self._teacher)

    async def rollout(self, input: Any, *, reward: RewardFn | None = None, config: dict[str, Any] | None = None,
                      context: Any = None, method: Method = "astream", rollout_id: str | None = None,
                      seed: int | None = None) -> Trajectory:
        """Run the graph once on ``input`` and return the run as a scored trajectory.

        Args:
            input: the graph's input (e.g. ``{"messages": [...]}``).
            reward: ``reward(trajectory, final_state) -> float``, plain or async. If it raises, the error is
                recorded on the trajectory (``logs``, ``metadata["reward_error"]``) and the reward stays 0.
            config: the graph's ``RunnableConfig`` (``configurable``, ``callbacks``...).
            context: the run's static context, for a graph built with ``StateGraph(..., context_schema=...)`` whose
                nodes read ``runtime.context`` (LangGraph passes it as ``graph.invoke(input, context=...)``).
                Default: none passed.
            method: how the graph is run (see the module docstring).
            rollout_id: default: a new random id.
            seed: seeds the sampling: the run's k-th call to the trainable model is sampled with a seed derived
                from ``seed`` and k (unless the chat model sets ``seed`` itself), so a graph that makes its calls
                in a fixed order samples the same tokens when run again with the same seed and adapter. Default:
                unseeded.

        Raises:
            NoTrainableCallsError: the graph never called the trainable model (the message lists what it called),
                or no call of it sampled a token before the run stopped (the message says why).
            Exception: whatever the graph raises, except its step limit and the timeout, which end the run
                early and mark the trajectory ``metadata["truncated"]``.

        A run that paused for a human (``interrupt()`` or a static breakpoint) is marked too:
        ``stop_reason="interrupted"`` and ``metadata["interruptions"]``, the nodes waiting to run.
        """
        if method not in _METHODS:
            raise ConfigError(f"method {method!r} is unknown: use one of {', '.join(_METHODS)}")
        run_config = dict(config or {})
        if self.recursion_limit is not None:
            run_config.setdefault("recursion_limit", self.recursion_limit)
        bound = getattr(self.graph, "config", None)  # graph.with_config(recursion_limit=...): astream_events
        if isinstance(bound, dict) and "recursion_limit" in bound:  # alone would leave it out (LangGraph 1.2)
            run_config.setdefault("recursion_limit", bound["recursion_limit"])
        from langgraph.errors import GraphRecursionError

        scope = self._scope(rollout_id=rollout_id, seed=seed, tracers=rollout_tracers(self._tracers), input=input)
        progress = _Progress()
        stop_reason = None
        deadline = asyncio.timeout(self.timeout)
        async with scope:
            run_config = scope.langchain_config(run_config)  # the tracers' handlers (Langfuse's), if any
            try:
                async with deadline:
                    await _run(self.graph, input, run_config, method, progress, context)
            except GraphRecursionError:
                stop_reason = "recursion_limit"
            except TimeoutError:
                if not deadline.expired():
                    raise  # the graph's own timeout (a tool's, a client's), not the rollout's limit
                stop_reason = "timeout"
        metadata = None
        if stop_reason is None and (waiting := await _paused_at(self.graph, run_config, progress.state)):
            stop_reason, metadata = "interrupted", {"interruptions": ", ".join(waiting)}
        await scope.settle()  # a call the timeout cut is recorded (tokens so far) once the gateway sees the cut
        trajectory = await scope.fetch_trajectory(final_state=progress.state, stop_reason=stop_reason,
                                                  metadata=metadata)
        return scope.scored(await score(trajectory, reward))

    async def group(self, input: Any, *, n: int, reward: RewardFn | None = None, config: dict[str, Any] | None = None,
                    context: Any = None, method: Method = "astream", seed: int | None = None) -> TrajectoryGroup:
        """``n`` rollouts of the same input run concurrently, as one group for GRPO.

        ``seed`` seeds the group: each rollout gets its own seed derived from it (see ``rollout``), so the
        rollouts differ from each other and the same group can be sampled again. Default: unseeded.
        A rollout that fails is left out and listed in ``group.exceptions``, not raised. Every rollout gets the
        same ``config`` and ``context``: with a checkpointer they share its ``thread_id`` (give each its own to keep
        them apart).
        """
        return await gather_group(n, lambda rollout_seed: self.rollout(input, reward=reward, config=config,
                                                                       context=context, method=method,
                                                                       seed=rollout_seed), seed=seed)

    def rollout_fn(self, *, reward: RewardFn | None = None,
                   agent: Any = None) -> Callable[[Any], Awaitable[Trajectory]]:
        """A function that runs the graph once on an input and returns the run as a scored trajectory.

        The method both adapters share (``TrainableRunner.rollout_fn`` takes the same arguments), for code that
        runs either one over a list of inputs, such as ``art_plugins.langfuse.evaluate``. The function takes the
        graph's input, or a string, which becomes a user message (``{"messages": [("user", text)]}``).

        Args:
            reward: as for ``rollout``.
            agent: for a ``TrainableRunner`` only: a graph is its own agent.

        Raises:
            ConfigError: an agent was given.
        """
        if agent is not None:
            raise ConfigError(f"agent= is for a TrainableRunner: {self!r} runs its own graph (got "
                              f"{type(agent).__name__}); leave it out")

        async def run(input: Any) -> Trajectory:
            return await self.rollout({"messages": [("user", input)]} if isinstance(input, str) else input,
                                      reward=reward)
        return run


async def _paused_at(graph: Any, config: dict[str, Any], state: Any) -> tuple[str, ...]:
    """The nodes a run paused before, waiting to be resumed (an ``interrupt()`` or a static breakpoint,
    ``interrupt_before=[...]``); empty when it ran to its end.

    With a checkpointer, the thread's snapshot says (``next``: the nodes still to run). Without one, an
    ``interrupt()`` still shows in the final state (``"__interrupt__"``: named ``"interrupt()"``, its node
    unknown); a static breakpoint leaves no trace.
    """
    from langgraph.checkpoint.base import BaseCheckpointSaver

    bound = getattr(graph, "config", None)  # graph.with_config(configurable={"thread_id": ...}) binds it there
    configurable = {**((bound.get("configurable") or {}) if isinstance(bound, dict) else {}),
                    **(config.get("configurable") or {})}
    if isinstance(getattr(graph, "checkpointer", None), BaseCheckpointSaver) and \
            configurable.get("thread_id") is not None:
        config = {**config, "configurable": configurable}
        try:
            snapshot = await graph.aget_state(config)
        except NotImplementedError:  # a checkpointer with no async methods (SqliteSaver)
            snapshot = await asyncio.to_thread(graph.get_state, config)
        return tuple(str(node) for node in snapshot.next)
    if isinstance(state, dict) and state.get("__interrupt__"):
        return ("interrupt()",)  # which node called it, only a checkpointer's snapshot tells
    return ()


class _Progress:
    """The latest graph state a run has shown (kept when the run is cut short)."""

    state: Any = None


async def _run(graph: Any, input: Any, config: dict[str, Any], method: Method, progress: _Progress,
               context: Any = None) -> None:
    # context= only when given: a graph object from before LangGraph 0.6 (or a look-alike) may not take it
    extra: dict[str, Any] = {"context": context} if context is not None else {}
    if method == "ainvoke":
        progress.state = await graph.ainvoke(input, config, **extra)
    elif method == "invoke":
        progress.state = await _in_own_thread(functools.partial(graph.invoke, **extra), input, config)
    elif method == "astream":
        async for state in graph.astream(input, config, stream_mode="values", **extra):
            progress.state = state
    else:
        interrupts = None
        async for event in graph.astream_events(input, config, version="v2", **extra):
            if event.get("parent_ids"):
                continue
            if event["event"] == "on_chain_stream":  # an interrupt() reaches the root only as a stream chunk
                chunk = event["data"].get("chunk")
                if isinstance(chunk, dict) and "__interrupt__" in chunk:
                    interrupts = chunk["__interrupt__"]
            elif event["event"] == "on_chain_end":
                progress.state = event["data"].get("output")
                # The other methods' final state carries the interrupts; the root's end event leaves them out.
                # (A static breakpoint, interrupt_before=[...], streams an empty tuple: no key, as for the others.)
                if interrupts and isinstance(progress.state, dict):
                    progress.state = {**progress.state, "__interrupt__": interrupts}


async def _in_own_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a new thread, with a copy of the caller's context (the rollout's route follows the call).

    Not ``asyncio.to_thread``: on the event loop's default pool (``min(32, cores + 4)`` threads), a group of
    ``invoke`` rollouts larger than the pool would queue behind itself and behind the user's other blocking code,
    and a rollout's timeout could run out before it started. Cancelling the caller stops the wait, not the run.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.done():  # the rollout was cancelled (its timeout) while the graph ran on
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (context.run(fn, *args), None)
        except BaseException as exc:  # handed to the awaiting rollout, which raises it
            outcome = (None, exc)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name="art-langgraph-invoke", daemon=True).start()
    return await done


@overload
def trainable(graph: TrainableModel, model: None = None, *, model_names: Iterable[str] | None = None,
              recursion_limit: int | None = None, timeout: float | None = None, langfuse: Any = None
              ) -> Callable[[Callable[..., Any]], Callable[..., TrainableGraph]]: ...
@overload
def trainable(graph: Any, model: TrainableModel, *, model_names: Iterable[str] | None = None,
              recursion_limit: int | None = None, timeout: float | None = None, langfuse: Any = None
              ) -> TrainableGraph: ...
def trainable(graph: Any, model: TrainableModel | None = None, *, model_names: Iterable[str] | None = None,
              recursion_limit: int | None = None, timeout: float | None = None, langfuse: Any = None) -> Any:
    """Wrap a compiled graph (``trainable(graph, model)``), or decorate a function that builds one.

    As a decorator, ``@trainable(model)`` turns ``def build_graph(...) -> CompiledGraph`` into a function
    returning a ``TrainableGraph``; the builder's own code does not change.
    """
    options = {"model_names": model_names, "recursion_limit": recursion_limit, "timeout": timeout, "langfuse": langfuse}
    if model is None:
        if not isinstance(graph, TrainableModel):
            raise ConfigError("trainable() needs a model: trainable(graph, model), or @trainable(model) on a "
                              "function that builds the graph")
        chosen = graph

        def decorate(build: Callable[..., Any]) -> Callable[..., TrainableGraph]:
            @functools.wraps(build)
            def build_trainable(*args: Any, **kwargs: Any) -> TrainableGraph:
                return TrainableGraph(build(*args, **kwargs), chosen, **options)
            return build_trainable
        return decorate
    return TrainableGraph(graph, model, **options)
