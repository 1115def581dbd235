"""Langfuse dataset runs: ``evaluate`` runs an adapter on every item of a dataset, as one experiment run.

Each item runs through ``target.rollout_fn(...)``, the method both adapters share, so this module imports
neither adapter: anything with ``model``, ``langfuse`` and ``rollout_fn`` can be evaluated.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from art_core import TrainableModel, Trajectory, TrajectoryGroup
from art_core.errors import ConfigError
from art_core.rewards import RewardFn

from ._langfuse_delivery import bounded, plain
from ._langfuse_options import resolve
from ._langfuse_traces import dataset_item, reward_scores
from ._tracing import tracing_rollouts

if TYPE_CHECKING:
    from langfuse.api import DatasetItem

__all__ = ["DatasetRun", "Evaluable", "current_dataset_item", "evaluate"]


class Evaluable(Protocol):
    """What ``evaluate`` runs: ``TrainableGraph`` and ``TrainableRunner`` both are."""

    model: TrainableModel
    langfuse: Any

    def rollout_fn(self, *, reward: RewardFn | None = None,
                   agent: Any = None) -> Callable[[Any], Awaitable[Trajectory]]: ...


def current_dataset_item() -> DatasetItem | None:
    """The Langfuse dataset item being evaluated (``input``, ``expected_output``, ``metadata``), in ``evaluate``.

    Reward functions read the expected output here: ``current_dataset_item().expected_output``.
    """
    return dataset_item.get()


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


async def evaluate(target: Evaluable, dataset: str, *, run_name: str, agent: Any = None,
                   reward: RewardFn | None = None, input: Callable[[Any], Any] | None = None, langfuse: Any = True,
                   description: str | None = None, max_concurrency: int = 4,
                   metadata: Mapping[str, str] | None = None) -> DatasetRun:
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
    if not callable(getattr(target, "rollout_fn", None)) or not isinstance(getattr(target, "model", None),
                                                                           TrainableModel):
        raise ConfigError(f"evaluate() takes a TrainableGraph or a TrainableRunner, got {type(target).__name__}")
    run_one = target.rollout_fn(reward=reward, agent=agent)  # checks the agent now, before any item runs
    convert = input or (lambda value: value)
    tracing = resolve(getattr(target, "langfuse", None) or langfuse, target.model)
    if tracing is None:
        raise ConfigError("evaluate() records a Langfuse dataset run: pass langfuse=True or a client")
    try:
        done, items = await bounded(lambda: tracing.client.get_dataset(dataset), tracing.flush_timeout * 4)
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
            trajectory = await run_one(convert(item.input))
        except Exception as exc:
            failures.append(f"item {item.id}: {type(exc).__name__}: {exc}")
            raise
        finally:
            pending[0] -= 1
            if pending[0] <= 0:
                finished.set()
        trajectories[trajectory.id] = trajectory
        return {"output": trajectory.metadata.get("final_output") or plain(trajectory.final_state),
                "trajectory_id": trajectory.id}

    async def task(*, item: Any, **_: Any) -> Any:
        # Langfuse runs the experiment in a thread with its own event loop; the rollout must run on ours
        # (the gateway and the agent's clients live there). The context, OpenTelemetry's included, goes along:
        # the rollout is traced by this tracing (whatever the adapter's option) and joins the item's trace.
        item_token = dataset_item.set(item)
        try:
            with tracing_rollouts(tracing):
                return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(one(item), loop))
        finally:
            dataset_item.reset(item_token)

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
