"""``TrainableModel``: the handle a user trains through.

    model = TrainableModel(name="math-agent", base_model="smollm2-135m-instruct")
    await model.register(LocalBackend())          # loads the base + the latest checkpoint
    await model.train_sft("demos.jsonl")             # optional warm start: one SFT step -> checkpoints/NNNN
    await model.train(groups, config=TrainConfig())  # one GRPO step -> checkpoints/NNNN
    model.step                                    # completed steps
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from ._names import check_name
from .config import LoraSettings, SFTConfig, TrainConfig
from .errors import ConfigError, LifecycleError
from .types import CallRecord, Trajectory, TrajectoryGroup, chat_messages

if TYPE_CHECKING:
    from .backends.base import Backend, GatewayAccess, ModelSpec
    from .tracking import ReportTo, TrackingSession
    from .gateway.records import ExchangeRecord
    from .wire import RolloutStatus

__all__ = ["StepHook", "TrainableModel"]

logger = logging.getLogger(__name__)

StepHook: TypeAlias = Callable[["TrainableModel", list[TrajectoryGroup], dict[str, Any]], Awaitable[None] | None]
"""Called after each ``train`` with the model (``model.step`` is the new step), the groups and the step's
metrics; sync or async. What observability layers (``art_plugins.langfuse``) attach to."""

T = TypeVar("T")

EMBEDDED_MODEL = "smollm2-135m-instruct"


class TrainableModel:
    """A base model plus a LoRA adapter trained with GRPO (``train``), and supervised fine-tuning (``train_sft``).

    Args:
        name: the model's name; also its folder under ``<root>/<project>/models/``.
        project: groups models on disk.
        base_model: a local Hugging Face model directory, or a registered name
            (``"smollm2-135m-instruct"``, the embedded default).
        lora: the adapter's shape; fixed for the model's life.
        report_to: experiment trackers that get every step's metrics, the run's config and a table of the best
            and worst trajectories: ``"wandb"``, ``"mlflow"``, ``"tensorboard"``, ``"trackio"``, tracker objects
            (``art_core.tracking``), or a list of them; ``"all"``: each of the four whose package is installed.
            None (default): none, and no tracker library is imported.
            A tracker that fails never fails a step. See ``art_core.tracking``.

    Raises:
        ConfigError: a bad name, or a tracker whose package is not installed.
    """

    def __init__(self, *, name: str, project: str = "default", base_model: str | Path = EMBEDDED_MODEL,
                 lora: LoraSettings | None = None, report_to: ReportTo = None) -> None:
        self.name = check_name("model name", name)
        self.project = check_name("project name", project)
        self.base_model = base_model
        self.lora = lora or LoraSettings()
        self._backend: Backend | None = None
        self._gateway: GatewayAccess | None = None  # the backend, or what ``attach`` was given
        self._step = 0
        self._step_hooks: list[StepHook] = []
        # report_to lives on the model, as TRL's lives on the trainer's args: it spans the whole run, while a
        # TrainConfig is per step. It is checked here, before any work starts; libraries load at the first step.
        self._trackers = self._resolve_trackers(report_to)
        self._tracking: TrackingSession | None = None
        self._reporting: concurrent.futures.Future[None] | None = None  # the last step's report, being sent
        # The trackers' config sections: "train" (GRPO's TrainConfig) and "sft" (SFTConfig), each as its latest
        # step ran it, so that SFT then GRPO shows both rather than whichever came first.
        self._step_configs: dict[str, dict[str, Any]] = {}
        self._last_step_end: float | None = None
        from .backends.base import ModelSpec

        self._spec = ModelSpec(name=self.name, project=self.project, base_model=str(base_model), lora=self.lora)

    def __repr__(self) -> str:
        return f"TrainableModel(name={self.name!r}, project={self.project!r}, step={self._step})"

    @property
    def step(self) -> int:
        """Completed training steps: the number of the checkpoint being served (0 = the base model)."""
        return self._step

    @property
    def spec(self) -> ModelSpec:
        """The plain-data description a backend loads the model from (name, project, base model, LoRA)."""
        return self._spec

    @property
    def backend(self) -> Backend:
        """The backend the model is registered with (any implementation of ``art_core.backends.Backend``)."""
        if self._backend is None:
            if self._gateway is not None:
                raise LifecycleError(f"model {self.name!r} only reaches a gateway (it was attached with "
                                     "model.attach): training, sampling and checkpoints live with the backend that "
                                     "serves it; return trajectories to the process that registered the model")
            raise LifecycleError(f"model {self.name!r} is not registered: call `await model.register(backend)` first")
        return self._backend

    @property
    def gateway_access(self) -> GatewayAccess:
        """What the adapters reach the model's gateway through: the backend, or the object given to ``attach``."""
        if self._gateway is None:
            return self.backend  # raises: not registered
        return self._gateway

    async def register(self, backend: Backend) -> None:
        """Attach to a backend: loads the base model and resumes from the latest complete checkpoint.

        Args:
            backend: ``LocalBackend``, ``RemoteBackend``, ``RayBackend`` or any ``Backend`` implementation.

        Raises:
            LifecycleError: the model is already registered.
            ConfigError: ``backend`` does not implement the ``Backend`` contract.
            BaseModelNotFoundError: the base model cannot be found.
        """
        from .backends.base import Backend

        if self._backend is not None:
            raise LifecycleError(f"model {self.name!r} is already registered; create another TrainableModel "
                                 "to register it elsewhere")
        if not isinstance(backend, Backend):
            raise ConfigError(f"register() needs a backend (LocalBackend, RemoteBackend, ...), got "
                              f"{type(backend).__name__}: it lacks methods of art_core.backends.Backend")
        self._step = await backend.register(self.spec)
        self._backend = self._gateway = backend

    def attach(self, gateway: GatewayAccess, *, step: int) -> None:
        """Reach a gateway that another process trains behind, for rollouts only (a Ray rollout worker's model).

        The rollout URLs, key and records work as after ``register``; ``train``, ``sample`` and the checkpoint
        calls raise ``LifecycleError``: they belong to the process that registered the model.

        Args:
            gateway: what reaches the gateway (``art_core.backends.GatewayAccess``, e.g. ``GatewayView``).
            step: the step it serves (``model.step``).

        Raises:
            LifecycleError: the model is already registered or attached.
            ConfigError: ``gateway`` does not implement ``GatewayAccess``.
        """
        from .backends.base import GatewayAccess

        if self._gateway is not None:
            raise LifecycleError(f"model {self.name!r} is already registered; create another TrainableModel "
                                 "to attach it elsewhere")
        if not isinstance(gateway, GatewayAccess):
            raise ConfigError(f"attach() needs a GatewayAccess (base_url, api_key, rollout_base_url, "
                              f"rollout_records, rollout_status), got {type(gateway).__name__}")
        self._gateway, self._step = gateway, step

    async def train(self, groups: Sequence[TrajectoryGroup], *, config: TrainConfig | None = None) -> dict[str, float]:
        """Run one GRPO step on ``groups`` and serve the new checkpoint.

        The groups are written to ``trajectories/NNNN.jsonl`` before training starts. When every group has
        equal rewards (nothing to learn), no checkpoint is written and ``step`` stays the same.

        Returns:
            The step's metrics (also appended to ``history.jsonl``).

        Raises:
            ConfigError: no group, or ``config`` is not a ``TrainConfig`` (SFT settings go to ``train_sft``).
        """
        groups = list(groups)
        if not groups:
            raise ConfigError("train() got no group: gather at least one TrajectoryGroup first")
        config = config or TrainConfig()
        if not isinstance(config, TrainConfig):
            raise ConfigError(f"train() takes a TrainConfig, not {type(config).__name__}: supervised steps go to "
                              "model.train_sft(data, config=SFTConfig(...))")
        return await self._run_step(groups, config)

    async def train_sft(self, data: str | Path | Sequence[Trajectory] | Sequence[TrajectoryGroup], *,
                        config: SFTConfig | None = None) -> dict[str, float]:
        """Run one supervised fine-tuning step on ``data`` and serve the new checkpoint.

        The step is ``config.epochs`` passes over the trajectories, one optimizer step per ``config.batch_size``
        of them, and writes one checkpoint: the same step counter, checkpoints and ``history.jsonl`` as ``train``
        (its row says ``kind: "sft"``), so GRPO steps resume on the adapter it wrote. Every trajectory is trained
        on, whatever its reward; the loss is the NLL of the assistant's tokens only (all turns, or each
        trajectory's last: ``config.assistant_turns``). Trajectories with call records are trained token-exact;
        those without (a chat file, demonstrations) are rendered with the base model's chat template and counted
        in ``samples_rerendered``. The data is written to ``trajectories/NNNN.jsonl`` first, as one group per
        given group (trajectories and files: one group).

        Args:
            data: a JSONL file of OpenAI-format chats (``art_core.sft.read_chat_file``: checked whole before any
                work), trajectories (``select_for_sft`` picks them from scored groups), or groups.
            config: the SFT settings; default ``SFTConfig()``.

        Returns:
            The step's metrics (``loss``: mean of its optimizer steps' losses, ``loss_first``, ``loss_last``...).

        Raises:
            ChatFileError: the file has malformed lines (each named with its line number); nothing was trained.
            ConfigError: ``data`` is empty or not one of the accepted kinds, or ``config`` is not an ``SFTConfig``.
            TrajectoryError: a trajectory has nothing to train on or is longer than ``max_sequence_length``.
        """
        config = config or SFTConfig()
        if not isinstance(config, SFTConfig):
            raise ConfigError(f"train_sft() takes an SFTConfig, not {type(config).__name__}: GRPO settings go to "
                              "model.train(groups, config=TrainConfig(...))")
        return await self._run_step(_sft_groups(data), config)

    async def _run_step(self, groups: list[TrajectoryGroup], config: TrainConfig | SFTConfig) -> dict[str, float]:
        """One step of either kind through the backend, then the step hooks and the trackers."""
        started = time.perf_counter()
        result = await self.backend.train(self.spec, groups, config)
        self._step = result.step
        await self._run_step_hooks(groups, result.metrics)
        if self._trackers:
            seconds = {"step": time.perf_counter() - started}
            if self._last_step_end is not None:  # the rollouts (and anything else the loop did) since the last step
                seconds["rollouts"] = started - self._last_step_end
            await self._report(groups, result.metrics, config, seconds)
        self._last_step_end = time.perf_counter()
        return result.metrics

    async def finish_tracking(self) -> None:
        """Wait for the last step's report, then end the trackers' runs (W&B ``finish``, MLflow run marked
        finished, files closed). A later ``train`` resumes the same runs. Does nothing without ``report_to``."""
        if self._tracking is not None:
            await self._reported()
            await asyncio.wrap_future(self._tracking.submit(self._tracking.finish))

    @property
    def tracking(self) -> TrackingSession | None:
        """The model's trackers and their failure count (``tracking.failures``); None without ``report_to`` or
        before the first step."""
        return self._tracking

    @staticmethod
    def _resolve_trackers(report_to: ReportTo) -> list[Any]:
        if report_to is None or (isinstance(report_to, list | tuple) and not report_to):
            return []  # off: art_core.tracking is not even imported
        from .tracking import resolve_trackers

        return resolve_trackers(report_to)

    async def _report(self, groups: list[TrajectoryGroup], metrics: dict[str, Any], config: TrainConfig | SFTConfig,
                      seconds: dict[str, float]) -> None:
        """Send the step's report in the background: the trackers' I/O (an MLflow server, W&B's service) then
        overlaps the next rollouts instead of adding to the step. One report in flight at a time, in order:
        the previous one is waited for first (normally done long before)."""
        if self._tracking is None:
            from .tracking import TrackingSession

            self._tracking = TrackingSession(self._trackers, self._tracking_folder())
        await self._reported()
        self._step_configs["sft" if isinstance(config, SFTConfig) else "train"] = config.model_dump()
        run_config = {"project": self.project, "model": self.name, "base_model": str(self.base_model),
                      "lora": self.lora.model_dump(), **self._step_configs}
        tracking, step = self._tracking, self._step
        self._reporting = tracking.submit(lambda: tracking.report(
            step=step, metrics=dict(metrics), groups=list(groups), config=run_config, project=self.project,
            name=self.name, seconds=seconds))

    async def _reported(self) -> None:
        """Wait until the last step's report has been sent (it never raises: the session counts failures)."""
        if self._reporting is not None:
            reporting, self._reporting = self._reporting, None
            await asyncio.wrap_future(reporting)

    def _tracking_folder(self) -> Path:
        """``<model_dir>/tracking`` when the model's folder is on this machine (Local, Ray, a server on this
        host); else ``./art-tracking/<project>/<name>`` (a ``RemoteBackend`` on another machine)."""
        model_dir = self.model_dir
        if model_dir.is_dir():
            return model_dir / "tracking"
        return Path.cwd() / "art-tracking" / self.project / self.name

    def add_step_hook(self, hook: StepHook) -> Callable[[], None]:
        """Call ``hook(model, groups, metrics)`` after every ``train`` (sync or async).

        A hook that raises is logged and skipped: it never fails the step, which is already on disk.

        Returns:
            A function that removes the hook.
        """
        self._step_hooks.append(hook)
        return lambda: self._step_hooks.remove(hook) if hook in self._step_hooks else None

    async def _run_step_hooks(self, groups: list[TrajectoryGroup], metrics: dict[str, Any]) -> None:
        for hook in list(self._step_hooks):
            try:
                outcome = hook(self, groups, metrics)
                if inspect.isawaitable(outcome):
                    await outcome
            except Exception:  # observability must not fail training: the checkpoint is written already
                logger.exception("step hook %r failed after step %d", hook, self._step)

    async def sample(self, messages: Sequence[dict[str, Any]], *, n: int = 1, max_tokens: int = 256,
                     temperature: float = 1.0, tools: list[dict[str, Any]] | None = None,
                     seed: int | None = None) -> list[Trajectory]:
        """Sample ``n`` replies to a chat in process, each as a Trajectory with its token-exact record.

        Agents reach the model through the gateway; this is the direct path for simple tasks and tests.

        Raises:
            ConfigError: a message is not a chat message (a bad role, no role), or ``n`` or ``max_tokens`` is not
                an int >= 1 (before anything is sent).
        """
        for name, value in (("n", n), ("max_tokens", max_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"sample({name}={value!r}): give an int >= 1")
        messages = list(messages)
        chat_messages(messages, where="sample()")
        return await self.backend.sample(self.spec, messages, n=n, max_tokens=max_tokens,
                                         temperature=temperature, tools=tools, seed=seed)

    @property
    def base_url(self) -> str:
        """The gateway's OpenAI base URL (``http://127.0.0.1:PORT/v1``), for any OpenAI-compatible client."""
        return self.gateway_access.base_url(self.spec)

    @property
    def api_key(self) -> str | None:
        """The key the gateway wants in ``Authorization: Bearer``; None when it listens on loopback only."""
        return self.gateway_access.api_key(self.spec)

    def rollout_base_url(self, rollout_id: str) -> str:
        """A base URL whose calls the gateway records under ``rollout_id``."""
        return self.gateway_access.rollout_base_url(self.spec, rollout_id)

    def rollout_calls(self, rollout_id: str) -> list[CallRecord]:
        """The token-exact records of a rollout's calls, oldest first, ready for ``Trajectory.calls``."""
        return [r.to_call_record() for r in self.rollout_records(rollout_id)]

    async def fetch_rollout_records(self, rollout_id: str) -> list[ExchangeRecord]:
        """The gateway's full records of a rollout's calls (conversation, reply, tokens), oldest first.

        A coroutine: with a remote backend it is one HTTP round trip, which never blocks the event loop.
        """
        return await _awaited(self.gateway_access.rollout_records(self.spec, rollout_id), "rollout_records")

    async def fetch_rollout_status(self, rollout_id: str) -> RolloutStatus:
        """What the gateway knows of a rollout's calls beyond their records: ``unanswered``, the calls it received
        and has not answered yet (a rollout that ended with some never saw their answers), and its state."""
        return await _awaited(self.gateway_access.rollout_status(self.spec, rollout_id), "rollout_status")

    def rollout_records(self, rollout_id: str) -> list[ExchangeRecord]:
        """``fetch_rollout_records``, waited for: for scripts and tests. It blocks its thread until the records
        come (over HTTP with a remote backend), so async code should ``await model.fetch_rollout_records(...)``."""
        return _wait_for(lambda: self.fetch_rollout_records(rollout_id))

    def rollout_status(self, rollout_id: str) -> RolloutStatus:
        """``fetch_rollout_status``, waited for (it blocks its thread; see ``rollout_records``)."""
        return _wait_for(lambda: self.fetch_rollout_status(rollout_id))

    def rollout_trajectory(self, rollout_id: str, **fields: Any) -> Trajectory:
        """The rollout rebuilt from its records, one history per distinct context (see ``art_core.trajectories``).

        Raises:
            TrajectoryError: the rollout made no call to this model.
        """
        from .trajectories import trajectory_from_records

        return trajectory_from_records(self.rollout_records(rollout_id), **fields)

    @property
    def model_dir(self) -> Path:
        """``<root>/<project>/models/<name>``: checkpoints, trajectories and history."""
        return self.backend.model_dir(self.spec)

    async def prepare_training(self, config: TrainConfig | SFTConfig | None = None) -> None:
        """Have the trainer make now what a first step under ``config`` would make at its start: the copies of the
        frozen base weights that ``base_matmul_dtype`` and ``prepacked_base_weights`` ask for (SmolLM2-135M
        pre-packed in fp32: ~0.8 s of one core). ``pipeline`` calls it while the first rollouts run, when the trainer
        would idle anyway; call it the same way in a loop of your own, and await it before the first ``train``.
        Where the backend prepares nothing (``RemoteBackend``: the server's trainer makes them at its first step),
        it returns at once."""
        prepare = getattr(self.backend, "prepare_training", None)
        if prepare is not None:
            await prepare(self.spec, config or TrainConfig())

    async def checkpoints(self) -> list[int]:
        """The steps of the complete checkpoints on the backend's disk, oldest first."""
        return await self.backend.checkpoints(self.spec)

    async def delete_checkpoints(self, steps: Sequence[int]) -> list[int]:
        """Delete checkpoints by step (the one being served is kept); returns the steps deleted."""
        return await self.backend.delete_checkpoints(self.spec, list(steps))

    async def history(self) -> list[dict[str, Any]]:
        """The rows of ``history.jsonl``: one per ``train`` call, with its metrics."""
        return await self.backend.history(self.spec)


def _sft_groups(data: str | Path | Sequence[Trajectory] | Sequence[TrajectoryGroup]) -> list[TrajectoryGroup]:
    """``train_sft``'s data as groups: a chat file read and checked, trajectories wrapped in one group."""
    if isinstance(data, str | Path):
        from .sft import read_chat_file

        return [TrajectoryGroup(read_chat_file(data))]
    items = list(data)
    if not items:
        raise ConfigError("train_sft() got no data: pass a chat file, trajectories or groups")
    if all(isinstance(item, TrajectoryGroup) for item in items):
        groups: list[TrajectoryGroup] = items  # type: ignore[assignment]
    elif all(isinstance(item, Trajectory) for item in items):
        groups = [TrajectoryGroup(items)]  # type: ignore[arg-type]
    else:
        kinds = sorted({type(item).__name__ for item in items})
        raise ConfigError(f"train_sft() takes a chat file path, trajectories or groups, not a list of "
                          f"{', '.join(kinds)}")
    _check_sft_messages(groups)
    return groups


def _check_sft_messages(groups: list[TrajectoryGroup]) -> None:
    """Trajectories without call records (hand-written, a teacher's demonstrations) are trained from their messages:
    check those as a chat file's lines are checked, every problem at once (recorded ones train token-exact)."""
    from .sft.chat_export import chat_problems
    from .sft.chat_file import MAX_PROBLEMS

    problems = chat_problems(t for group in groups for t in group.trajectories
                             if not any(h.calls for h in t.histories()))
    if problems:
        more = f"\n  ... and {len(problems) - MAX_PROBLEMS} more" if len(problems) > MAX_PROBLEMS else ""
        raise ConfigError(f"train_sft(): {len(problems)} problem(s) in the trajectories' messages; fix them and run "
                          "again:\n  " + "\n  ".join(problems[:MAX_PROBLEMS]) + more)


def _wait_for(start: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run the coroutine ``start()`` makes to its end from synchronous code, and return its result.

    Outside an event loop, on a new one. Inside one (sync code called from async code), on a thread of its own
    with its own loop: the caller's loop cannot run it while its thread waits here, and is blocked meanwhile.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(start())
    with ThreadPoolExecutor(1, thread_name_prefix="art-wait") as pool:
        return pool.submit(lambda: asyncio.run(start())).result()


async def _awaited(value: Any, method: str) -> Any:
    """``value`` awaited; a third-party backend's synchronous method still works, with a deprecation warning."""
    if inspect.isawaitable(value):
        return await value
    import warnings

    warnings.warn(f"Backend.{method} returned a value, not a coroutine: since art-core 0.1.0 (November 2026) "
                  f"GatewayAccess.{method} is async (the adapters read records on the event loop); synchronous "
                  f"ones are deprecated and will stop working in 0.2.0: make it `async def {method}`",
                  DeprecationWarning, stacklevel=3)
    return value
