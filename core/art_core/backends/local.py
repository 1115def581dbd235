"""``LocalBackend``: trains in this process and serves through an engine of your choice, on CPU or local GPUs.

Per model it keeps a trainer (``trainer="peft"`` or ``"unsloth"``, see ``_trainers.py``) and an inference
engine (``inference="transformers"`` or ``"vllm"``, see ``_engines.py``), serves the engine through an
OpenAI-compatible gateway (``model.base_url``), and owns the on-disk layout
``<path>/<project>/models/<name>/{checkpoints/NNNN, trajectories/, records.jsonl, history.jsonl, logs/}``.

A training step runs as on every backend (``_steps.StepRunner``: groups to disk, pause, train, checkpoint,
publish, history, resume); this backend supplies how it trains (the trainer's step in a worker thread) and how
it publishes (vLLM hot-loads the checkpoint; the transformers engine that decodes the trainer's own module just
records the step). If publishing fails, the gateway stays paused with the error until a later step succeeds.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .._ownership import torch_threads
from .._threads import TRAINING
from ..config import SFTConfig, TrainConfig
from ..errors import ConfigError
from ..types import TrajectoryGroup
from ._engines import (EngineContext, Serving, TransformersOptions, VLLMOptions, inference_choice, shares_module,
                       transformers_options)
from ._progress import progress_bar
from ._shared import ServesModels
from ._tables import ModelTable
from ._steps import EngineHold, StepRunner, Trained
from ._trainers import trainer_choice
from .base import ModelSpec, Progress

if TYPE_CHECKING:
    from ..gateway import Gateway
    from ..training.trainer import GRPOTrainer

__all__ = ["LocalBackend"]

T = TypeVar("T")


@dataclass
class _Slot:
    trainer: GRPOTrainer
    serving: Serving
    steps: StepRunner
    gateway: Gateway | None = None

    @property
    def engine(self) -> Any:
        return self.serving.engine


@dataclass
class _LocalSteps:
    """How a step trains and publishes in this process (``_steps.StepWork``)."""

    backend: LocalBackend
    trainer: GRPOTrainer
    serving: Serving
    threads: int | None = None
    """Torch threads a step trains with (None: the process's setting)."""
    engine_threads: tuple[int, int] | None = None
    """The engine's decode threads while a step trains and while none does (None: left as they are)."""
    _steps_training: int = 0

    async def train(self, groups: list[TrajectoryGroup], config: TrainConfig | SFTConfig, *, step: int,
                    progress: Progress | None, **options: Any) -> Trained:
        # A worker thread of the library's own: the loop keeps serving I/O while the step runs.
        with _trainer_warnings_silenced(), self._engine_share():
            metrics = await TRAINING.run(_in_threads, self.threads,
                                         lambda: self._train_sync(groups, config, step, progress))
        return Trained(metrics, self.trainer.save if metrics.get("trained") else None)

    async def prepare(self, config: TrainConfig | SFTConfig) -> None:
        """``GRPOTrainer.prepare`` in a training thread, the engine's threads shared as during a step."""
        with self._engine_share():
            await TRAINING.run(_in_threads, self.threads, lambda: self.trainer.prepare(config))

    @contextlib.contextmanager
    def _engine_share(self) -> Iterator[None]:
        """While the step trains, the engine decodes with its share of the threads; with them all otherwise."""
        if self.engine_threads is None:
            yield
            return
        during, otherwise = self.engine_threads
        self._steps_training += 1  # counted: a step that ends must not hand back threads another one still uses
        self.serving.engine.num_threads = during
        try:
            yield
        finally:
            self._steps_training -= 1
            if not self._steps_training:
                self.serving.engine.num_threads = otherwise

    def _train_sync(self, groups: list[TrajectoryGroup], config: TrainConfig | SFTConfig, step: int,
                    report: Progress | None) -> dict[str, Any]:
        with progress_bar(f"training step {step}", enabled=self.backend.show_progress and report is None) as bar:
            # The module is at the checkpoint before this step: samples an older one drew are off-policy.
            return dict(self.trainer.train_step(groups, config, progress=report or bar, policy_step=step - 1))

    async def publish(self, checkpoint: Path, step: int) -> None:
        await self.serving.publish(checkpoint, step)


@contextlib.contextmanager
def _trainer_warnings_silenced() -> Iterator[None]:
    """While a step trains: the trainer's ``ZeroVarianceGroupsWarning`` and ``StaleGroupsWarning``, which the
    training thread would charge to a line of ours, are left to the step runner, which warns at the user's
    ``model.train`` line instead. Only those categories, only when charged to an art_core module; the filters are
    removed when the step ends."""
    from ..training.trainer import StaleGroupsWarning, ZeroVarianceGroupsWarning

    entries = []
    for category in (ZeroVarianceGroupsWarning, StaleGroupsWarning):
        warnings.filterwarnings("ignore", category=category, module=r"art_core\.")
        entries.append(warnings.filters[0])
    try:
        yield
    finally:
        for entry in entries:
            with contextlib.suppress(ValueError):  # someone reset the filters meanwhile: nothing left to remove
                warnings.filters.remove(entry)
        warnings._filters_mutated()  # type: ignore[attr-defined]


class LocalBackend(ServesModels):
    """Runs training and sampling in this process; implements ``art_core.backends.Backend``.

    Args:
        path: root folder of projects (checkpoints, trajectories, history).
        inference: the engine that serves rollouts: ``"transformers"`` (in process; default, best on CPU and
            for small models) or ``"vllm"`` (a vLLM subprocess that hot-loads each checkpoint; fastest rollouts,
            the choice on GPUs). See ``art_core.backends._engines`` for the layouts.
        trainer: how the LoRA step runs: ``"peft"`` (transformers + PEFT, CPU or GPU; default) or
            ``"unsloth"`` (Unsloth's kernels, NVIDIA GPUs only, ``art-core[unsloth]``).
        device: the trainer's device, ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; default: CUDA when available,
            else CPU.
        inference_device: the engine's device; default: ``device``. With ``inference="vllm"`` on CUDA, the
            trainer's GPU gives the shared layout (vLLM sleeps during steps), another GPU the dedicated one.
        vllm: how vLLM is started (its venv, ``gpu_memory_utilization``, dtype, extra arguments).
        transformers: how the transformers engine is built (``TransformersOptions``: ``packed_weights`` for
            faster CPU decoding at a small cost in log-prob exactness, the prompt-state cache, the batch size).
            Only with ``inference="transformers"``.
        host: the gateway's address. Anything but loopback needs ``api_key``.
        api_key: bearer token the gateway requires (``model.api_key`` hands it to the adapters).
        default_max_tokens: ``max_tokens`` of requests that set none; agents written for hosted models
            rarely set it, and a small model may ramble until this limit. Default: 1024 (the gateway's).
        max_tokens_limit: the largest ``max_tokens`` a request may ask for (more gets 400). Default: 4096.
        num_threads: torch threads while this backend loads and trains (restored after each call); default:
            leave torch's setting. On a small shared CPU, fewer threads than cores avoids collapse. With
            ``pause_during_step=False`` on CPU, where the engine decodes while a step trains, the default splits
            torch's threads between the two while a step trains (the trainer half, the engine half; the engine
            has them all between steps) unless either count is given (``TransformersOptions.num_threads``).
        show_progress: show a progress bar during training steps.
        serve: start an OpenAI-compatible gateway for each registered model (needs ``art-core[serve]``).
        gateway_mount: serve each gateway inside the caller's ASGI app rather than on a loopback port of its
            own: called with the model's spec, it returns the URL the caller serves ``gateway(model).app`` at
            (``art-core serve`` puts every model's gateway on its one port this way). None: own ports.
        pause_during_step: hold requests while a step trains (True, the default: every request after a step is
            served by its checkpoint). False: the engine keeps serving the last published checkpoint during the
            step and switches when the next one is published, each request running wholly on one adapter (its
            record's ``adapter_step`` says which); the asynchronous pipeline runs so. Needs an engine with weights
            of its own: vLLM, or ``transformers=TransformersOptions(separate_module=True)``.

    Raises:
        ConfigError: an unknown ``inference`` or ``trainer`` name, a choice that cannot run here (Unsloth
            without an NVIDIA GPU, vLLM without its venv), ``transformers`` options with another engine,
            ``pause_during_step=False`` with the engine decoding the trainer's module, or invalid gateway settings.
            Nothing is loaded.
    """

    def __init__(self, *, path: str | Path = ".art", inference: str = "transformers", trainer: str = "peft",
                 device: str | None = None, inference_device: str | None = None, vllm: VLLMOptions | None = None,
                 transformers: TransformersOptions | None = None, host: str = "127.0.0.1", api_key: str | None = None, default_max_tokens: int | None = None,
                 max_tokens_limit: int | None = None, num_threads: int | None = None, show_progress: bool = True,
                 serve: bool = True, gateway_mount: Callable[[ModelSpec], str] | None = None,
                 pause_during_step: bool = True) -> None:
        self.inference = inference
        self.trainer = trainer
        self._inference = inference_choice(inference)
        self._trainer = trainer_choice(trainer)
        self.vllm = vllm or VLLMOptions()
        self.transformers = transformers_options(transformers, inference)
        self._trainer.check(device)
        self._inference.check(self.vllm)
        self.pause_during_step = pause_during_step
        if not pause_during_step and inference == "transformers" and shares_module(
                self._trainer.shares_with_engine, self.transformers, inference_device or device or "", device or ""):
            raise _shared_module_refusal()
        self.serve = serve
        self.gateway_mount = gateway_mount
        self.path = Path(path)
        self.device = device
        self.inference_device = inference_device
        self.num_threads = num_threads
        self.show_progress = show_progress
        self._gateway_options: dict[str, Any] = {"host": host, "api_key": api_key}
        if default_max_tokens is not None:
            self._gateway_options["default_max_tokens"] = default_max_tokens
        if max_tokens_limit is not None:
            self._gateway_options["max_tokens_limit"] = max_tokens_limit
        if serve:
            from ..gateway.settings import GatewaySettings

            GatewaySettings(**self._gateway_options)  # checked now: a bad host or limit fails before any load
        self._models: ModelTable[_Slot] = ModelTable(self.path, "LocalBackend")

    @staticmethod
    def serving_during_steps(inference: str = "transformers") -> dict[str, Any]:
        """The keyword arguments that keep ``inference`` serving while a step trains (for ``pipeline``):
        ``pause_during_step=False``, and for the transformers engine the separate-module layout (a second copy
        of the base in memory: the engine must not decode the module a step changes, and the backend refuses to
        choose that memory for you). ``LocalBackend(path=..., inference=..., **LocalBackend.serving_during_steps())``.
        """
        options: dict[str, Any] = {"pause_during_step": False}
        if inference == "transformers":
            options["transformers"] = TransformersOptions(separate_module=True)
        return options

    def __repr__(self) -> str:
        return (f"LocalBackend(path={str(self.path)!r}, inference={self.inference!r}, trainer={self.trainer!r}, "
                f"models={len(self._models.slots)})")

    async def __aenter__(self) -> LocalBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the gateways and release the models. The backend cannot be used afterwards."""
        for slot in self._models.close():
            if slot.gateway is not None:
                await slot.gateway.aclose()
            await slot.engine.aclose()

    # -- the Backend contract (called by TrainableModel; the rest is ServesModels') ----------------------

    async def register(self, model: ModelSpec) -> int:
        self._models.check_new(model)
        self._models.check_folder(model)
        slot = await self._load(model)
        try:
            if self.serve:
                slot.gateway = await self._start_gateway(model, slot.engine)
        except BaseException:
            await slot.engine.aclose()
            raise
        slot.steps.hold = slot.gateway.control if slot.gateway is not None else EngineHold(slot.engine)
        self._models.add(model, slot)
        return slot.steps.step

    # -- serving ----------------------------------------------------------------------------------------

    async def _start_gateway(self, model: ModelSpec, engine: Any) -> Gateway:
        try:
            from ..gateway import Gateway, GatewaySettings, RecordStore
        except ImportError as exc:
            raise ConfigError(f"serving needs the gateway's dependencies ({exc.name} is missing): "
                              "pip install 'art-core[serve]', or LocalBackend(serve=False)") from exc
        base_name = Path(str(model.base_model)).name  # a folder path is served under its last component
        settings = GatewaySettings(model_name=model.name, base_model_name=base_name,
                                   records_path=self.model_dir(model) / "records.jsonl", **self._gateway_options)
        gateway = Gateway(engine, settings, RecordStore(settings.records_path))
        if self.gateway_mount is not None:
            return gateway.attach(self.gateway_mount(model))
        return await gateway.start()

    # -- work done in a worker thread -----------------------------------------------------------------

    async def _load(self, model: ModelSpec) -> _Slot:
        import torch

        from ..models import resolve_base_model
        from ..training.checkpoints import check_adapter_shape, latest_checkpoint, remove_interrupted_writes
        from ..training.trainer import GRPOTrainer

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        base_dir = resolve_base_model(model.base_model)
        model_dir = self.model_dir(model)
        remove_interrupted_writes(model_dir)  # a killed process's half-written checkpoint: nothing writes now
        latest = latest_checkpoint(model_dir)
        adapter_dir = latest.path if latest else None
        if latest:
            check_adapter_shape(latest.path, model.lora, model=model.name)

        def load_trainer() -> GRPOTrainer:
            policy, tokenizer = self._trainer.load(base_dir, model.lora, device, adapter_dir)
            trainer = GRPOTrainer(policy, tokenizer, share_prefix=self._trainer.share_prefix)
            if latest:
                trainer.load_optimizer_state(latest.path)
            return trainer

        trainer = await TRAINING.run(_in_threads, self.num_threads, load_trainer)
        step = latest.step if latest else 0
        serving = await self._inference.start(EngineContext(
            spec=model, base_dir=base_dir, policy=trainer.model, tokenizer=trainer.tokenizer, step=step,
            adapter_dir=adapter_dir, trainer_device=device, inference_device=self.inference_device or device,
            trainer_shares=self._trainer.shares_with_engine, vllm=self.vllm, log_dir=model_dir / "logs",
            transformers=self.transformers))
        if not self.pause_during_step and serving.layout == "shared-module":  # devices resolved to one after all
            await serving.engine.aclose()
            raise _shared_module_refusal()
        work = _LocalSteps(self, trainer, serving, self.num_threads)
        if self._splits_threads(serving, {device, self.inference_device or device}):
            total = torch.get_num_threads()
            work.threads, engine_share = _split_threads(total)
            work.engine_threads = (engine_share, total)
            serving.engine.num_threads = total
        steps = StepRunner(name=model.name, model_dir=model_dir, step=step, work=work,
                           hold=EngineHold(serving.engine), engine_label=self.inference,
                           pause_during_step=self.pause_during_step)
        return _Slot(trainer, serving, steps)

    # -- helpers --------------------------------------------------------------------------------------

    def _splits_threads(self, serving: Serving, devices: set[str]) -> bool:
        """Whether the trainer and the engine each get a share of the CPU threads: they run at once on CPU (the
        engine keeps decoding while a step trains, in a module of its own) and no thread count was given."""
        return (not self.pause_during_step and serving.layout == "separate-module" and devices == {"cpu"}
                and self.num_threads is None and self.transformers.num_threads is None)


def _in_threads(count: int | None, fn: Callable[[], T]) -> T:
    with torch_threads(count):  # scoped: restored after, also when two models step at once
        return fn()


def _split_threads(total: int) -> tuple[int, int]:
    """(trainer, engine) torch threads out of ``total`` while a step trains: halves, the trainer taking the odd
    one (its products are the bigger ones), and at least one each."""
    engine = max(1, total // 2)
    return max(1, total - engine), engine


def _shared_module_refusal() -> ConfigError:
    return ConfigError(
        "pause_during_step=False keeps serving while a step trains, but the transformers engine would decode the "
        "trainer's own module (the 'shared-module' layout), which a step changes under it. Give the engine weights "
        "of its own: transformers=TransformersOptions(separate_module=True) (the 'separate-module' layout, a second "
        "copy of the base in memory), or inference='vllm'; or keep pause_during_step=True")
