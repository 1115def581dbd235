"""``pipeline``: rollouts that never wait for training, with a bound on how stale a trained group may be.

    report = await pipeline(model, tasks, play, steps=20, groups_per_step=4, max_off_policy=1, concurrency=8)

``play(task)`` runs one group of rollouts of a task and returns its ``TrajectoryGroup`` (an adapter's
``agent.group(task, n=8, reward=...)``, or a function around ``model.sample``). Up to ``concurrency`` of them run
at once, continuously; a step starts as soon as ``groups_per_step`` groups are ready, on the stalest of them first
(the oldest adapter step in their records; equally stale ones in the order their rollouts started, so that a seeded
synchronous run trains the same batches every time), while rollouts go on.

**The bound.** A group's staleness is the number of steps the adapter moved between sampling it and training on
it (``art_core.training.staleness``). ``max_off_policy=m`` admits a new rollout only while the groups started so
far would all be trained within m steps of the checkpoint that samples them (at most ``groups_per_step * (m + 1)``
groups ahead of the last step), and passes ``m`` on as ``TrainConfig.max_off_policy``, so a group that still ends
up staler (a slow rollout) is dropped and counted, never trained past the bound. ``max_off_policy=0`` is the
synchronous loop: roll out one step's groups, train, repeat. Stale samples are corrected exactly, from the
sampler's recorded log-probs: in the loss's ratio by default (its clip range compounded over the steps since
sampling: ``TrainConfig.off_policy_trust_region``), or as a truncated importance weight with
``TrainConfig(off_policy_correction="weight")``; and a stale group's advantages are centred on the reward the
current adapter expects, not the one its sampler did (``TrainConfig.off_policy_baseline``).

Rollouts overlap training only when the backend keeps serving during a step
(``LocalBackend(pause_during_step=False)``); with the default policy they wait at the gateway during each step,
and the pipeline still keeps ``concurrency`` rollouts queued for the moment it resumes. Serving during steps, the
trainer does not wait for the engine either: with ``max_off_policy >= 1`` the next step is handed to the backend
as soon as its groups are ready, and it trains while the engine loads the checkpoint before it.

While the first rollouts run, the trainer makes what its first step would make at its start
(``TrainableModel.prepare_training``: the base weights' copies ``TrainConfig.prepacked_base_weights`` and
``base_matmul_dtype`` ask for), so that step runs as fast as the later ones.

**Nothing is lost.** Each step writes its groups to disk before training (as ``model.train`` always does). A rollout
that raises (or returns an empty group) is counted and the pipeline goes on; when ``max_failures_in_a_row``
rollouts fail with none succeeding in between (a typo in ``play``, a model name the adapter does not route, a
server down), it stops with a ``RolloutError`` whose cause is the last failure, instead of retrying forever. A
step that raises stops the pipeline with that error, after cancelling the rollouts in flight; its trajectories stay
on disk. Cancelling the pipeline (Ctrl-C) cancels the rollouts in flight and lets the steps already handed to the
backend finish (the one training, and the next one when it is queued behind it), so no checkpoint or history row is
left half-written.
The same holds when a step fails: a step queued behind it still trains before the error is raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import warnings
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .config import TrainConfig
from .errors import ConfigError, RolloutError
from .training.staleness import group_sampling_step
from .types import TrajectoryGroup

if TYPE_CHECKING:
    from .model import TrainableModel

__all__ = ["PipelineReport", "StepReport", "pipeline"]

T = TypeVar("T")


@dataclass
class StepReport:
    """One step of a pipeline: what its progress line says."""

    step: int
    """The checkpoint served after the step (the one it wrote; the previous one when every group was dropped)."""
    metrics: dict[str, Any]
    """``model.train``'s metrics (``reward_mean``, ``staleness_mean``, ``groups_stale``, ...)."""
    rollouts_failed: int
    """Rollouts that raised or came back empty since the previous step."""
    seconds_wall: float
    """Since the previous step ended (or the pipeline started)."""
    seconds_rollout: float
    """Of that, seconds at least one rollout was running."""
    seconds_train: float
    """Of that, seconds this step was training."""
    seconds_both: float
    """Of that, seconds both ran at once."""

    @property
    def overlap(self) -> float:
        """Share of the wall time both rolled out and trained."""
        return self.seconds_both / self.seconds_wall if self.seconds_wall > 0 else 0.0

    def line(self) -> str:
        m = self.metrics
        return (f"step {self.step}: reward {m.get('reward_mean', math.nan):.3f}, staleness mean "
                f"{m.get('staleness_mean', 0.0):.2f} max {m.get('staleness_max', 0.0):.0f}, "
                f"{m.get('groups_stale', 0.0):.0f} group(s) dropped as stale, {self.rollouts_failed} rollout(s) "
                f"failed, {self.seconds_rollout:.1f}s rolling out, {self.seconds_train:.1f}s training, both at once "
                f"{self.overlap:.0%} of {self.seconds_wall:.1f}s")


@dataclass
class PipelineReport:
    """What ``pipeline`` returns: its steps, and the rollouts that failed."""

    steps: list[StepReport] = field(default_factory=list)
    rollouts_failed: int = 0
    failures: list[BaseException] = field(default_factory=list)
    """The first few rollout failures (at most 20), for a look at what went wrong."""


class _Clock:
    """Seconds with rollouts running, with a step training, and with both, since the last ``lap``."""

    def __init__(self) -> None:
        self.rollouts = 0
        self.training = 0  # steps in flight
        self._last = self._lap_start = time.perf_counter()
        self.rollout = self.train = self.both = 0.0

    def _advance(self) -> None:
        now = time.perf_counter()
        dt, self._last = now - self._last, now
        self.rollout += dt if self.rollouts else 0.0
        self.train += dt if self.training else 0.0
        self.both += dt if self.rollouts and self.training else 0.0

    @contextlib.contextmanager
    def rolling_out(self) -> Iterator[None]:
        self._advance()
        self.rollouts += 1
        try:
            yield
        finally:
            self._advance()
            self.rollouts -= 1

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        self._advance()
        self.training += 1
        try:
            yield
        finally:
            self._advance()
            self.training -= 1

    def lap(self) -> tuple[float, float, float, float]:
        """(wall, rollout, train, both) seconds since the last lap; starts a new one."""
        self._advance()
        out = (self._last - self._lap_start, self.rollout, self.train, self.both)
        self._lap_start, self.rollout, self.train, self.both = self._last, 0.0, 0.0, 0.0
        return out


@dataclass
class _Ready(Generic[T]):
    group: TrajectoryGroup
    order: int

    @property
    def key(self) -> tuple[float, int]:
        step = group_sampling_step(self.group)
        return (math.inf if step is None else step, self.order)  # stalest first; unknown steps last


def stalest_first(ready: list[_Ready[Any]], count: int) -> list[TrajectoryGroup]:
    """Take the ``count`` stalest groups out of ``ready`` (ties: the one whose rollout started first).

    Ties go by start, not by finish: the order in which rollouts finish is a race, and a step's groups in another
    order train to other float roundings (another summation order), which a run at a high learning rate can
    amplify into another outcome. By start, the synchronous loop (``max_off_policy=0``) trains each step on the
    same groups in the same order on every run, so a seeded run repeats."""
    ready.sort(key=lambda r: r.key)
    taken, ready[:] = ready[:count], ready[count:]
    return [r.group for r in taken]


async def pipeline(model: TrainableModel, tasks: Iterable[T], play: Callable[[T], Awaitable[TrajectoryGroup]], *,
                   steps: int, groups_per_step: int, max_off_policy: int = 1, concurrency: int = 4,
                   config: TrainConfig | None = None,
                   log: Callable[[str], None] | None = print,
                   on_step: Callable[[StepReport, list[TrajectoryGroup]], None] | None = None,
                   max_failures_in_a_row: int | None = None) -> PipelineReport:
    """Roll out ``tasks`` continuously and train ``steps`` steps on the groups as they are ready.

    Args:
        model: a registered model (any backend).
        tasks: what to roll out, in order (``itertools.cycle(tasks)`` for epochs). If it runs out, the steps that
            can still be filled run, then the pipeline returns with a warning saying how many ran (a
            ``RolloutError`` when not one rollout succeeded).
        play: one task -> one ``TrajectoryGroup`` (its rollouts and rewards).
        steps: training steps to run.
        groups_per_step: groups each step trains on.
        max_off_policy: the staleness bound (module docstring); 0 is the synchronous loop. Default 1.
        concurrency: most rollouts (``play`` calls) running at once. Default 4.
        config: the steps' settings; its ``max_off_policy`` is replaced by this call's. Default ``TrainConfig()``.
        log: gets one progress line per step (``StepReport.line``); None: silent. Default ``print``.
        on_step: called after each step with its report and the groups it was given (stalest first), e.g. to
            plot or log them; the pipeline itself keeps no group after its step.
        max_failures_in_a_row: rollouts that may fail one after another, none succeeding, before the pipeline
            stops with a ``RolloutError``. Default: ``max(20, 2 * concurrency)``.

    Returns:
        A ``PipelineReport``.

    Raises:
        ConfigError: a count is below 1 or ``max_off_policy`` is negative (before any rollout).
        RolloutError: ``max_failures_in_a_row`` rollouts failed in a row (the steps already handed to the backend
            finished first), or the tasks ran out with every rollout failed; the last failure is its ``__cause__``.
        Exception: what a step raised; the pipeline stopped there, that step's trajectories are on disk.
        asyncio.CancelledError: the pipeline was cancelled (a step in progress finished first).
    """
    if max_failures_in_a_row is None:
        max_failures_in_a_row = max(20, 2 * concurrency) if isinstance(concurrency, int) else 20
    for name, value, low in (("steps", steps, 1), ("groups_per_step", groups_per_step, 1),
                             ("concurrency", concurrency, 1), ("max_off_policy", max_off_policy, 0),
                             ("max_failures_in_a_row", max_failures_in_a_row, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"pipeline({name}={value!r}): give an int >= {low}")
    if config is not None and not isinstance(config, TrainConfig):
        raise ConfigError(f"pipeline(config=...) takes a TrainConfig, not {type(config).__name__}: "
                          "pass config=TrainConfig(learning_rate=..., ...)")
    settings = (config or TrainConfig()).model_copy(update={"max_off_policy": max_off_policy})
    if hasattr(type(model), "backend"):  # a TrainableModel (not a stand-in): unregistered, LifecycleError naming
        model.backend  # noqa: B018  # model.register, before any rollout
    _check_loss(settings)
    return await _Pipeline(model, iter(tasks), play, steps, groups_per_step, max_off_policy, concurrency, settings,
                           log, on_step, max_failures_in_a_row).run()


def _check_loss(config: TrainConfig) -> None:
    """The loss's options checked now, as ``model.train`` checks them, rather than after the first rollouts; skipped
    where the trainer is not installed (a ``RemoteBackend`` client: its server checks them)."""
    try:
        from .training.trainer import check_config
    except ImportError:
        return
    check_config(config)


class _Pipeline(Generic[T]):
    def __init__(self, model: TrainableModel, tasks: Iterator[T], play: Callable[[T], Awaitable[TrajectoryGroup]],
                 steps: int, groups_per_step: int, max_off_policy: int, concurrency: int, config: TrainConfig,
                 log: Callable[[str], None] | None,
                 on_step: Callable[[StepReport, list[TrajectoryGroup]], None] | None,
                 max_failures_in_a_row: int) -> None:
        self.model, self.tasks, self.play, self.steps = model, tasks, play, steps
        self.per_step, self.bound, self.concurrency, self.config, self.log = (groups_per_step, max_off_policy,
                                                                              concurrency, config, log)
        self.on_step = on_step
        self.report = PipelineReport()
        self.clock = _Clock()
        self.ready: list[_Ready[T]] = []
        self.rollouts: set[asyncio.Task[None]] = set()
        self.changed = asyncio.Event()  # a rollout or a step ended: look again at what can start
        self.admitted = 0  # rollouts started that still count toward a step (failed and stale ones do not)
        self.done_steps = 0
        self.failed_since_step = 0
        self.max_failures_in_a_row = max_failures_in_a_row
        self.failed_in_a_row = 0  # rollouts failed since the last one that succeeded
        self.gave_up: RolloutError | None = None  # set when that count reaches the limit: run() raises it
        self.started = 0  # rollouts started, in order: a ready group's place among equally stale ones
        self.exhausted = False
        self.succeeded = 0  # rollouts whose group came back
        self.prepared: asyncio.Task[None] | None = None  # the trainer's preparation (run), awaited by each step

    async def run(self) -> PipelineReport:
        # Steps in flight, oldest first. Off-policy, a second one may start while the first runs: the backend
        # trains it once the first's checkpoint is written, while the engine loads that checkpoint (_steps.py).
        steps: list[asyncio.Task[Any]] = []
        in_flight = 2 if self.bound > 0 else 1
        # The trainer would idle through the first rollouts: it makes what its first step needs meanwhile.
        self.prepared = prepared = asyncio.create_task(self.model.prepare_training(self.config))
        try:
            while self.done_steps < self.steps:
                self._start_rollouts()
                while (len(steps) < in_flight and self.done_steps + len(steps) < self.steps
                       and len(self.ready) >= self.per_step):
                    step = asyncio.create_task(self._step(stalest_first(self.ready, self.per_step)))
                    step.add_done_callback(lambda _: self.changed.set())
                    steps.append(step)
                if not steps and self.exhausted and not self.rollouts:
                    break  # no task left and too few groups for another step
                self.changed.clear()
                await self.changed.wait()
                if self.gave_up is not None:
                    raise self.gave_up
                while steps and steps[0].done():
                    steps.pop(0).result()  # a failed step stops the pipeline with its error
        except BaseException:
            prepared.cancel()  # a no-op once done (the thread making the copies runs to its end)
            for task in self.rollouts:
                task.cancel()
            await asyncio.gather(*self.rollouts, prepared, return_exceptions=True)
            for step in steps:  # let the steps finish: no half-written checkpoint or row
                with contextlib.suppress(BaseException):
                    # read even when done: a step queued behind the failed one may have failed too, and an error
                    # never read is logged by asyncio as "never retrieved"; the first error is the one raised
                    await (step if step.done() else asyncio.shield(step))
            raise
        for task in self.rollouts:  # enough steps: rollouts still running are not needed
            task.cancel()
        # the preparation is done unless the tasks ran out before any step: waited for (its error read), so that it
        # never runs beside the caller's next step
        await asyncio.gather(*self.rollouts, prepared, return_exceptions=True)
        if self.done_steps < self.steps:
            self._ran_out()
        return self.report

    def _ran_out(self) -> None:
        """The tasks ran out before ``steps`` steps: say so (a finite dataset is fine; a broken ``play`` is not)."""
        failed = self.report.rollouts_failed
        if failed and self.succeeded == 0:
            last = self.report.failures[-1]
            error = RolloutError(
                f"pipeline: the tasks ran out with every rollout failed ({failed} of {failed}, 0 step(s) done); the "
                f"last: {type(last).__name__}: {last}. Fix play() or what it calls (its traceback is the cause below)")
            raise error from last
        warnings.warn(  # stacklevel 4: the caller's `await pipeline(...)` line
            f"pipeline: the tasks ran out after {self.done_steps} of {self.steps} step(s) ({len(self.ready)} group(s) "
            f"left untrained, fewer than groups_per_step={self.per_step}; {failed} rollout(s) failed): pass "
            f"itertools.cycle(tasks) for more than one pass, or ask for fewer steps", stacklevel=4)

    def _start_rollouts(self) -> None:
        # Admit while the groups started would all be trained within `bound` steps of the checkpoint sampling them.
        limit = self.per_step * (self.done_steps + 1 + self.bound)
        while not self.exhausted and len(self.rollouts) < self.concurrency and self.admitted < limit:
            try:
                task = next(self.tasks)
            except StopIteration:
                self.exhausted = True
                return
            self.admitted += 1
            rollout = asyncio.create_task(self._rollout(task, self.started))
            self.started += 1
            self.rollouts.add(rollout)
            rollout.add_done_callback(self._rollout_done)

    def _rollout_done(self, task: asyncio.Task[None]) -> None:
        self.rollouts.discard(task)
        self.changed.set()

    async def _rollout(self, task: T, order: int) -> None:
        with self.clock.rolling_out():
            try:
                group = await self.play(task)
                if not isinstance(group, TrajectoryGroup):
                    raise ConfigError(f"play({task!r}) returned {type(group).__name__}, not a TrajectoryGroup: "
                                      f"return TrajectoryGroup(trajectories)")
                if len(group) == 0:
                    first = f"; the first: {group.exceptions[0]}" if group.exceptions else ""
                    raise ValueError(f"every rollout of the group failed ({len(group.exceptions)} exception(s)"
                                     f"{first})")
            except (Exception, asyncio.CancelledError) as exc:  # counted, reported, and replaced by the next task
                current = asyncio.current_task()
                if isinstance(exc, asyncio.CancelledError) and current is not None and current.cancelling():
                    raise  # the pipeline cancelled this rollout (it ends, or it is cancelled itself)
                # a CancelledError that play() let out (a timeout or task of its own): a failure like any other
                self.admitted -= 1
                self.failed_since_step += 1
                self.report.rollouts_failed += 1
                if len(self.report.failures) < 20:
                    self.report.failures.append(exc)
                self.failed_in_a_row += 1
                if self.failed_in_a_row >= self.max_failures_in_a_row and self.gave_up is None:
                    self.gave_up = RolloutError(
                        f"pipeline: {self.failed_in_a_row} rollouts failed in a row, none succeeding in between "
                        f"({self.report.rollouts_failed} failed in all, {self.done_steps} step(s) done); the last: "
                        f"{type(exc).__name__}: {exc}. Fix play() or what it calls (its traceback is the cause "
                        f"below), or raise max_failures_in_a_row= if such failures pass")
                    self.gave_up.__cause__ = exc
                return
        self.failed_in_a_row = 0
        self.succeeded += 1
        self.ready.append(_Ready(group, order))

    async def _step(self, groups: list[TrajectoryGroup]) -> None:
        with self.clock.stepping():
            if self.prepared is not None:  # done long before, unless the first rollouts were quicker
                await self.prepared  # its error, if any, stops the pipeline here
            metrics = await self.model.train(groups, config=self.config)
        self.admitted -= int(metrics.get("groups_stale", 0))  # dropped: their places go to new rollouts
        self.done_steps += 1
        wall, rollout, train, both = self.clock.lap()
        report = StepReport(self.model.step, dict(metrics), self.failed_since_step, wall, rollout, train, both)
        self.failed_since_step = 0
        self.report.steps.append(report)
        if self.log is not None:
            self.log(report.line())
        if self.on_step is not None:
            self.on_step(report, groups)
