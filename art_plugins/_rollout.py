"""One captured agent run: the scope the adapters open, and what they share.

    scope = RolloutScope(model, framework="langgraph")
    async with scope:               # calls for the trainable model now go to the rollout's gateway URL
        state = await graph.ainvoke(...)
    trajectory = scope.trajectory(final_state=state)
    await score(trajectory, reward)

The trajectory is rebuilt from the gateway's records of the rollout (``art_core.trajectories``), so every
trainable call in it is token-exact by construction.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterable
from contextvars import ContextVar
from types import TracebackType
from typing import Any

from art_core import TrainableModel, Trajectory, TrajectoryGroup
from art_core.errors import ArtError, ConfigError
from art_core.rewards import RewardFn, reward_value
from art_core.trajectories import trajectory_from_records

from ._routing import Route, routed

__all__ = ["NoTrainableCallsError", "RewardFn", "RolloutScope", "check_langfuse", "current_group_id", "gather_group",
           "langfuse_trace", "score"]

logger = logging.getLogger(__name__)

_group_id: ContextVar[str | None] = ContextVar("art_plugins_group_id", default=None)


def current_group_id() -> str | None:
    """The id ``gather_group`` gave the group the current rollout belongs to (None outside a group)."""
    return _group_id.get()


class NoTrainableCallsError(ArtError):
    """A rollout finished without calling the trainable model: there is nothing to train on."""


class RolloutScope:
    """Routes the trainable model's calls to the gateway under a fresh rollout id, as a (sync or async) context.

    Args:
        model: the registered ``TrainableModel``.
        model_names: the names the agent uses for the model; its calls naming any of them are routed.
            Default: the model's own name.
        framework: recorded in ``metadata["framework"]``.
        caller: returns the label of the part of the agent making the current call (stored per call).
        rollout_id: default: a new random id.
    """

    def __init__(self, model: TrainableModel, *, model_names: Iterable[str] | None = None, framework: str,
                 caller: Callable[[], str | None] | None = None, rollout_id: str | None = None) -> None:
        names = frozenset(model_names) if model_names is not None else frozenset({model.name})
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(f"model_names must be non-empty strings, got {sorted(map(repr, names))}")
        self.model = model
        self.framework = framework
        self.rollout_id = rollout_id or f"{framework}-{uuid.uuid4().hex[:16]}"
        gateway_url = model.rollout_base_url(self.rollout_id)  # validates the id; raises if not registered
        self.route = Route(model_names=names, served_name=model.name, base_url=gateway_url,
                           api_key=model.api_key, caller=caller)
        self._scope: Any = None
        # Chosen now, not when the trajectory is built, so that a trace can be named after it while the run goes.
        self.trajectory_id = uuid.uuid4().hex[:12]
        self.trace: Any = None
        """The rollout's Langfuse trace (``art_plugins.langfuse.RolloutTrace``), opened and closed with the scope."""

    def __enter__(self) -> RolloutScope:
        self._scope = routed(self.route)
        self._scope.__enter__()
        if self.trace is not None:
            self.trace.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.trace is not None:
            self.trace.__exit__(exc_type, exc, tb)
        scope, self._scope = self._scope, None
        if scope is not None:
            scope.__exit__(exc_type, exc, tb)

    async def __aenter__(self) -> RolloutScope:
        return self.__enter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.__exit__(exc_type, exc, tb)

    def trajectory(self, *, final_state: Any = None, stop_reason: str | None = None,
                   metadata: dict[str, Any] | None = None) -> Trajectory:
        """The run as a trajectory: histories from the gateway's records, the final state attached.

        Args:
            final_state: what the run ended with (kept in memory on ``trajectory.final_state``).
            stop_reason: why the run stopped early (``"recursion_limit"``, ``"timeout"``, ``"max_turns"``...);
                the trajectory is then marked ``metadata["truncated"] = True``.
            metadata: more labels.

        Raises:
            NoTrainableCallsError: the run never called the trainable model (the message lists what it called).
        """
        records = self.model.rollout_records(self.rollout_id)
        if not records:
            seen = ", ".join(f"{name!r} ({count}x)" for name, count in self.route.models_seen.items()) or "none"
            raise NoTrainableCallsError(
                f"rollout {self.rollout_id} never called the trainable model (routed names: "
                f"{sorted(self.route.model_names)}); models called over the OpenAI API: {seen}. Construct the "
                "agent's chat model with one of the routed names, or pass model_names=[...] naming the one it uses")
        labels: dict[str, Any] = {"framework": self.framework, "rollout_id": self.rollout_id,
                                  "truncated": stop_reason is not None}
        if stop_reason is not None:
            labels["stop_reason"] = stop_reason
        trajectory = trajectory_from_records(records, id=self.trajectory_id, metadata={**labels, **(metadata or {})})
        trajectory.final_state = final_state
        return self.trace.link(trajectory) if self.trace is not None else trajectory

    def scored(self, trajectory: Trajectory) -> Trajectory:
        """The scored trajectory, its scores sent to Langfuse when the rollout is traced."""
        return self.trace.finish(trajectory) if self.trace is not None else trajectory


def langfuse_trace(option: Any, scope: RolloutScope, input: Any) -> Any:
    """The rollout's Langfuse trace (``art_plugins.langfuse.RolloutTrace``), or None when Langfuse is off.

    Off (``option`` falsy), nothing of Langfuse is imported, unless ``art_plugins.langfuse`` already is (its
    ``evaluate`` turns tracing on for the rollouts it runs).
    """
    if not option and "art_plugins.langfuse" not in sys.modules:
        return None
    from .langfuse import rollout_trace

    return rollout_trace(option, scope, input)


def check_langfuse(option: Any, model: TrainableModel) -> None:
    """Validate an adapter's ``langfuse=`` option now (and trace the model's steps), not at the first rollout."""
    if option:
        from .langfuse import resolve

        resolve(option, model)


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


async def gather_group(n: int, rollout: Callable[[], Awaitable[Trajectory]]) -> TrajectoryGroup:
    """``n`` calls of ``rollout()`` run concurrently, as one group for GRPO.

    A rollout that fails is left out and listed in ``group.exceptions`` (and logged), not raised;
    ``KeyboardInterrupt`` and cancellation are not failures and propagate.
    """
    if n < 1:
        raise ConfigError(f"n is {n}: a group needs at least one rollout (GRPO needs two or more)")
    token = _group_id.set(uuid.uuid4().hex[:12])  # each rollout's task copies it (trace metadata: "group")
    try:
        results = await asyncio.gather(*(rollout() for _ in range(n)), return_exceptions=True)
    finally:
        _group_id.reset(token)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result
    errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    for message in errors:
        logger.warning("a rollout of the group failed: %s", message)
    return TrajectoryGroup([r for r in results if isinstance(r, Trajectory)], exceptions=errors)
