"""One training step, the same on every backend: ``StepRunner`` runs it, the backend supplies only what differs.

    runner = StepRunner(name=..., model_dir=..., step=..., work=work, hold=gateway.control, engine_label="vllm")
    outcome = await runner.run(groups, config, progress)     # one step at a time per model
    async with runner.serving():                             # sample: waits while a step runs
        ...

What a backend supplies (``StepWork``): ``train`` (run the step where its trainer lives: this process, a Ray
trainer group) and ``publish`` (make its engine(s) serve a checkpoint). Everything else is here, once:

1. the groups go to ``trajectories/NNNN.jsonl``: nothing is trained on that is not on disk first;
2. pause (the ``pause_during_step`` policy, on by default): the gateway stops admitting requests (they wait,
   they do not fail), in-flight ones finish, and the engine pauses;
3. train, then ``checkpoints/NNNN`` is written atomically (nothing when every group was dropped);
4. publish the checkpoint, then append the step's row to ``history.jsonl`` (``kind``: ``"grpo"``, or ``"sft"`` for a
   supervised step: the two kinds share the step counter and the checkpoints, so SFT step N is followed by GRPO
   step N+1 on the same adapter);
5. resume: the gateway checks the engine serves the new step, then releases the held requests.

If publishing fails (the adapter does not load, an engine process died), the trajectories and checkpoint stay
on disk, the gateway stays paused (it never serves the old step as if it were the new one), ``train`` raises
an ``EngineError`` naming the checkpoint and the cause, and ``sample`` raises it too. A later successful step
resumes serving. A step that fails before its checkpoint is written changes nothing: serving goes on.

With ``pause_during_step=False`` (``LocalBackend(pause_during_step=False)``, the asynchronous pipeline) requests keep
being served by the previous checkpoint while the next one trains; publishing swaps the adapter between requests
(the engine's ``load_adapter`` lets the requests in flight finish on the old one), and only a failed publish
pauses the gateway. The trainer does not wait for the engine either: once a step's checkpoint is written, the
next ``run`` may train while this one publishes (4-5); nor for the disk, where the step's files are its own
(``Trained.detached``: a Ray step's, already sent back as bytes): the next ``run`` trains while they are written.
Checkpoints are written, published and history rows appended in step order, and each ``run`` still returns once
the engine serves its checkpoint.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from .._threads import HELPERS
from .._warnings import warn_at_caller
from ..errors import EngineError
from ..types import TrajectoryGroup, trace_links, write_groups_jsonl
from ._shared import append_history, trajectories_path
from .base import Progress, TrainResult

if TYPE_CHECKING:
    from ..config import SFTConfig, TrainConfig
    from ..engines.base import Engine

__all__ = ["EngineHold", "Hold", "StepOutcome", "StepRunner", "StepWork", "Trained",
           "warn_dropped_groups"]



@dataclass
class Trained:
    """What a backend's ``StepWork.train`` returns."""

    metrics: dict[str, Any]
    """The step's metrics (``trained`` says whether the adapter changed)."""
    save: Callable[[Path], None] | None
    """Writes the new adapter's files into a folder (``write_checkpoint`` makes it atomic); None: nothing
    was trained, no checkpoint is written."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything more the backend's own callers want back (a Ray step's shares and gradients)."""
    detached: bool = False
    """``save`` writes what this step ended with, whatever trains next (a Ray step's files, already bytes here):
    serving during steps, the next step may then train while this one's checkpoint is written. False: ``save``
    reads the trainer's live state (the in-process trainer), so it runs before the next step may train."""


@dataclass
class StepOutcome:
    """What ``StepRunner.run`` returns."""

    result: TrainResult
    extra: dict[str, Any]
    """``Trained.extra``, as the backend's ``train`` returned it."""


class StepWork(Protocol):
    """What a backend supplies for one model's steps."""

    async def train(self, groups: list[TrajectoryGroup], config: TrainConfig | SFTConfig, *, step: int,
                    progress: Progress | None, **options: Any) -> Trained:
        """Run one step (GRPO or SFT, by ``config``) on ``groups`` (already on disk) as step ``step``; don't write
        the checkpoint."""
        ...

    async def prepare(self, config: TrainConfig | SFTConfig) -> None:
        """Make, where the trainer lives, what a first step under ``config`` would make at its start
        (``GRPOTrainer.prepare``: the base weights' copies)."""
        ...

    async def publish(self, checkpoint: Path, step: int) -> None:
        """Make the engine(s) serve ``checkpoint`` as ``step`` (requests are held; the runner releases them).

        Raises:
            Exception: the engine could not take it (the runner keeps the gateway paused with this error).
        """
        ...


class Hold(Protocol):
    """What holds requests around a step: the gateway's ``GatewayControl``, or ``EngineHold`` when there is no
    gateway (``LocalBackend(serve=False)``)."""

    @property
    def state(self) -> Literal["serving", "paused", "closed"]: ...

    async def pause_for_training(self) -> None: ...

    async def resume_after_training(self, expected_step: int) -> None: ...

    def admitted(self) -> Any:
        """An async context a request runs inside (it waits while paused)."""
        ...


class EngineHold:
    """``Hold`` over a bare engine (no gateway): pauses and resumes it, and checks the step it serves."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.state: Literal["serving", "paused", "closed"] = "serving"

    async def pause_for_training(self) -> None:
        self.state = "paused"
        await self.engine.pause()

    async def resume_after_training(self, expected_step: int) -> None:
        if self.engine.adapter_step != expected_step:
            raise EngineError(f"engine serves adapter {self.engine.adapter_step}, expected {expected_step}: "
                              f"checkpoint {expected_step:04d} was not loaded")
        await self.engine.resume()
        self.state = "serving"

    @asynccontextmanager
    async def admitted(self) -> AsyncIterator[None]:
        yield  # the engine's own queue orders requests; the runner's ``serving`` already waited for the step


class StepRunner:
    """One model's training steps: one at a time, in the order of the module docstring.

    Args:
        name: the model's name (for messages).
        model_dir: ``<root>/<project>/models/<name>``.
        step: the checkpoint served now (0: the base model).
        work: the backend's part (``StepWork``).
        hold: what holds requests during a step (``Hold``).
        engine_label: names the engine in errors (``"vllm"``, ``"transformers"``, ``"Ray replicas'"``).
        pause_during_step: hold requests while a step trains (the policy of the module docstring). Default: True.
    """

    def __init__(self, *, name: str, model_dir: Path, step: int, work: StepWork, hold: Hold, engine_label: str,
                 pause_during_step: bool = True) -> None:
        self.name, self.model_dir, self.step = name, model_dir, step
        self.work, self.hold, self.engine_label = work, hold, engine_label
        self.pause_during_step = pause_during_step
        self.error: BaseException | None = None
        """Why the engine does not serve ``step`` (a failed publish); requests stay held until a step succeeds."""
        self.waiting_steps = 0
        """``run`` calls waiting for the step before them to end."""
        self.waiting_samples = 0
        """``serving`` callers waiting for a step to end."""
        self._trained = step
        """The last step trained: ``step``, or one ahead while a detached checkpoint is being written (the next
        step is numbered after it, and trains on from it)."""
        self._lock = asyncio.Lock()  # one step trains at a time (with the pause policy: one step at all)
        self._writing = asyncio.Lock()  # detached checkpoints are written in step order
        self._publishing = asyncio.Lock()  # checkpoints are published, and history rows written, in step order
        self._idle = asyncio.Event()  # set while no step runs (with the pause policy): ``serving`` waits for it
        self._idle.set()

    async def run(self, groups: Sequence[TrajectoryGroup], config: TrainConfig | SFTConfig,
                  progress: Progress | None = None, *, train_id: str | None = None,
                  **options: Any) -> StepOutcome:
        """One step on ``groups``; a call made while another step runs waits for it (``options`` go to
        ``StepWork.train``). ``train_id`` (a server's train call) is written into the checkpoint with the step's
        metrics, so that a call resent after a crash between the two is answered, not trained twice.

        Raises:
            EngineError: the checkpoint was written but could not be served (see the module docstring).
            Exception: what training raised; nothing was written but the trajectories, serving goes on.
        """
        self.waiting_steps += 1
        try:
            await self._lock.acquire()
        finally:
            self.waiting_steps -= 1
        holding_trainer = True
        try:
            if self.pause_during_step:
                self._idle.clear()
            groups = list(groups)
            step, metrics, checkpoint, trained = await self._train(groups, config, progress, options, train_id)
            if trained.save is not None and self._written_after_release(trained):
                async with self._writing:
                    self._lock.release()
                    holding_trainer = False
                    checkpoint = await self._write_checkpoint(step, trained.save, config, metrics, train_id)
            async with self._publishing:
                if holding_trainer and not self.pause_during_step:  # the next step may train while this publishes
                    self._lock.release()
                    holding_trainer = False
                return await self._publish(self.step if checkpoint is None else step, groups, config, metrics,
                                           checkpoint, trained.extra)
        finally:
            self._idle.set()
            if holding_trainer:
                self._lock.release()

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """Run a direct request (``sample``) once no step runs, on the checkpoint served.

        Raises:
            EngineError: the last checkpoint could not be served (a failed publish).
        """
        self.waiting_samples += 1
        try:
            await self._idle.wait()
        finally:
            self.waiting_samples -= 1
        if self.error is not None:
            raise EngineError(f"model {self.name!r}: the engine does not serve checkpoint {self.step:04d} "
                              f"({self.error}); train another step once the cause is fixed") from self.error
        async with self.hold.admitted():
            yield

    async def _train(self, groups: list[TrajectoryGroup], config: TrainConfig | SFTConfig, progress: Progress | None,
                     options: dict[str, Any], train_id: str | None) -> tuple[int, dict[str, Any], Path | None, Trained]:
        """Steps 1-3 of the module docstring. Returns this step's number, its metrics, its checkpoint folder (None:
        nothing trained, or a detached save left for ``run`` to write once the trainer is free) and what the
        backend's ``train`` returned."""
        next_step = self._trained + 1
        # 1. everything the step learns from is on disk before it starts
        await HELPERS.run(write_groups_jsonl, trajectories_path(self.model_dir, next_step), groups)

        # 2. pause: requests wait (they do not fail); the engine drains and, on a shared GPU, sleeps
        if self.pause_during_step and self.hold.state == "serving":  # after a failed publish: paused already
            await self.hold.pause_for_training()

        # 3. train, then the checkpoint (atomic: a folder renamed into place)
        checkpoint: Path | None = None
        try:
            trained = await self.work.train(groups, config, step=next_step, progress=progress, **options)
            metrics = dict(trained.metrics)
            if trained.save is not None and self._written_after_release(trained):
                self._trained = next_step  # run() writes it; the next step trains on from this one meanwhile
            elif trained.save is not None:
                checkpoint = await self._write_checkpoint(next_step, trained.save, config, metrics, train_id)
        except BaseException:
            if self.error is None and self.hold.state == "paused":  # nothing changed: serve on as before
                await self.hold.resume_after_training(self.step)
            raise
        warn_dropped_groups(groups, config, next_step - 1, metrics)
        return next_step, metrics, checkpoint, trained

    def _written_after_release(self, trained: Trained) -> bool:
        """Whether the step's checkpoint is written once the trainer is free (``run``) rather than before: its files
        are its own (``Trained.detached``) and the next step may train while this one publishes."""
        return trained.detached and not self.pause_during_step

    async def _write_checkpoint(self, step: int, save: Callable[[Path], None], config: TrainConfig | SFTConfig,
                                metrics: dict[str, Any], train_id: str | None = None) -> Path:
        """``checkpoints/NNNN``, atomic (a folder renamed into place); ``self.step`` is then this step."""
        from ..training.checkpoints import write_checkpoint

        metadata = _checkpoint_metadata(config, metrics)
        if train_id is not None:
            metadata.update(train_id=train_id, metrics=metrics)
        checkpoint = await HELPERS.run(write_checkpoint, self.model_dir, step, save, metadata=metadata)
        self.step = self._trained = step
        return checkpoint

    async def _publish(self, step: int, groups: list[TrajectoryGroup], config: TrainConfig | SFTConfig,
                       metrics: dict[str, Any], checkpoint: Path | None, extra: dict[str, Any]) -> StepOutcome:
        """Steps 4-5 of the module docstring for ``step`` (``checkpoint``: its files; None: nothing was trained).
        ``self.step`` may be ahead by then: the next step trains while this one publishes."""
        # 4. publish, then the history row (written whether or not the engine took the checkpoint)
        failure: BaseException | None = None
        if checkpoint is not None:
            started = time.perf_counter()
            try:
                await self.work.publish(checkpoint, step)
            except Exception as exc:
                failure = exc
                metrics["adapter_load_error"] = str(exc)
            metrics["seconds_adapter_load"] = time.perf_counter() - started
        append_history(self.model_dir, {"step": step, "time": time.time(), "kind": config.kind, **metrics,
                                        **trace_links(groups)})
        if failure is not None:
            self.error = failure
            if self.hold.state == "serving":  # the policy let requests run: stop them reaching the old step
                await self.hold.pause_for_training()
            raise EngineError(f"checkpoint {step:04d} was trained and written to {checkpoint}, but the "
                              f"{self.engine_label} engine could not serve it, so the gateway stays paused (held "
                              f"requests wait; none is served by an older step). The step's trajectories are in "
                              f"{self.model_dir / 'trajectories'}. Cause: {failure}") from failure

        # 5. resume: the gateway checks the engine serves this step, then releases held requests
        if self.hold.state == "paused":
            try:
                await self.hold.resume_after_training(step)
            except Exception as exc:  # the engine serves another step: requests stay held
                self.error = exc
                raise
        self.error = None
        return StepOutcome(TrainResult(metrics=metrics, step=step), extra)


def _checkpoint_metadata(config: TrainConfig | SFTConfig, metrics: dict[str, Any]) -> dict[str, Any]:
    """What ``checkpoint.json`` says of the step that wrote it: its kind, and its loss (GRPO: the loss's name)."""
    if config.kind == "sft":
        return {"kind": "sft", "loss": "sft", "sft_loss": metrics["loss"], "reward_mean": metrics["reward_mean"]}
    return {"kind": "grpo", "loss": config.loss, "reward_mean": metrics["reward_mean"]}


def warn_dropped_groups(groups: list[TrajectoryGroup], config: TrainConfig | SFTConfig, policy_step: int,
                         metrics: dict[str, Any]) -> None:
    """Warn, at the user's ``model.train`` line, that groups were dropped: sampled too long ago
    (``TrainConfig.max_off_policy``), or with equal rewards. From the step's metrics alone, so a ``RemoteBackend``
    client warns as the process that trained does."""
    kept = list(range(len(groups)))
    if metrics.get("groups_stale"):
        from ..training.staleness import StaleGroupsWarning, staleness

        found = staleness(groups, policy_step, getattr(config, "max_off_policy", None))
        warn_at_caller(StaleGroupsWarning(found.message()))
        kept = [i for i in kept if i not in set(found.stale)]
    if not metrics.get("groups_dropped"):
        return
    from ..training.advantages import ZeroVarianceGroupsWarning, compute_group_advantages

    flat = compute_group_advantages([groups[i].rewards for i in kept], scale="none").dropped_groups
    dropped = [kept[i] for i in flat]
    warn_at_caller(ZeroVarianceGroupsWarning(
        f"{len(dropped)} of {len(kept)} group(s) had equal rewards for every trajectory and were dropped "
        f"(indices {dropped[:10]}); shape the reward so that rollouts of one task differ"))


