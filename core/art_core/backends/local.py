"""``LocalBackend``: trains in this process and serves through an engine of your choice, on CPU or local GPUs.

Per model it keeps a trainer (``trainer="peft"`` or ``"unsloth"``, see ``_trainers.py``) and an inference
engine (``inference="transformers"`` or ``"vllm"``, see ``_engines.py``), serves the engine through an
OpenAI-compatible gateway (``model.base_url``), and owns the on-disk layout
``<path>/<project>/models/<name>/{checkpoints/NNNN, trajectories/, records.jsonl, history.jsonl, logs/}``.

A training step, top to bottom (``train``):

1. pause: the gateway stops admitting requests (they wait, they do not fail), in-flight ones finish, and the
   engine pauses (a vLLM sharing the trainer's GPU also sleeps, freeing its memory);
2. the step's groups go to ``trajectories/NNNN.jsonl``, one GRPO step runs, ``checkpoints/NNNN`` is written;
3. publish: the engine takes the checkpoint (vLLM hot-loads it; the transformers engine that decodes the
   trainer's own module just records the step);
4. resume: the gateway checks the engine serves the new step, then releases the held requests.

If publishing fails (the adapter does not load, the vLLM process died), the trajectories and checkpoint stay
on disk, the gateway stays paused (it never serves the old step as if it were the new one), and ``train``
raises the engine's error; ``sample`` raises it too. A later successful step resumes serving.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .._ownership import torch_threads
from .._threads import TRAINING
from ..config import TrainConfig
from ..engines.base import SamplingParams
from ..errors import ConfigError, EngineError, LifecycleError
from ..types import Trajectory, TrajectoryGroup, trace_links, write_groups_jsonl
from ._engines import EngineContext, Serving, TransformersOptions, VLLMOptions, inference_choice
from ._progress import progress_bar
from ._shared import append_history, read_history, render_chat, sampled_trajectories, trajectories_path
from ._trainers import trainer_choice
from .base import ModelSpec, TrainResult

if TYPE_CHECKING:
    from ..gateway import Gateway
    from ..gateway.records import ExchangeRecord
    from ..training.trainer import GRPOTrainer
    from ..wire import RolloutStatus

__all__ = ["LocalBackend"]

T = TypeVar("T")


@dataclass
class _Slot:
    trainer: GRPOTrainer
    serving: Serving
    model_dir: Path
    step: int
    """The latest checkpoint written (what the engine serves, unless publishing it failed: see ``error``)."""
    stepping: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One training step at a time per model."""
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while no step is running; ``sample`` waits for it."""
    error: BaseException | None = None
    """Why the engine does not serve ``step`` (a failed publish); requests stay held until a step succeeds."""
    gateway: Gateway | None = None

    @property
    def engine(self) -> Any:
        return self.serving.engine


class LocalBackend:
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
            leave torch's setting. On a small shared CPU, fewer threads than cores avoids collapse.
        show_progress: show a progress bar during training steps.
        serve: start an OpenAI-compatible gateway for each registered model (needs ``art-core[serve]``).
        gateway_mount: serve each gateway inside the caller's ASGI app rather than on a loopback port of its
            own: called with the model's spec, it returns the URL the caller serves ``gateway(model).app`` at
            (``art-core serve`` puts every model's gateway on its one port this way). None: own ports.

    Raises:
        ConfigError: an unknown ``inference`` or ``trainer`` name, a choice that cannot run here (Unsloth
            without an NVIDIA GPU, vLLM without its venv), ``transformers`` options with another engine, or
            invalid gateway settings. Nothing is loaded.
    """

    def __init__(self, *, path: str | Path = ".art", inference: str = "transformers", trainer: str = "peft",
                 device: str | None = None, inference_device: str | None = None, vllm: VLLMOptions | None = None,
                 transformers: TransformersOptions | None = None, host: str = "127.0.0.1", api_key: str | None = None, default_max_tokens: int | None = None,
                 max_tokens_limit: int | None = None, num_threads: int | None = None, show_progress: bool = True,
                 serve: bool = True, gateway_mount: Callable[[ModelSpec], str] | None = None) -> None:
        self.inference = inference
        self.trainer = trainer
        self._inference = inference_choice(inference)
        self._trainer = trainer_choice(trainer)
        self.vllm = vllm or VLLMOptions()
        if transformers is not None and inference != "transformers":
            raise ConfigError(f"transformers= configures the transformers engine, but inference={inference!r}: "
                              "drop transformers= or use inference='transformers'")
        if transformers is not None and not isinstance(transformers, TransformersOptions):
            raise ConfigError(f"transformers= takes a TransformersOptions, not {type(transformers).__name__}: "
                              "e.g. TransformersOptions(packed_weights=True)")
        self.transformers = transformers or TransformersOptions()
        self._trainer.check(device)
        self._inference.check(self.vllm)
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
        self._slots: dict[tuple[str, str], _Slot] = {}
        self._closed = False

    def __repr__(self) -> str:
        return (f"LocalBackend(path={str(self.path)!r}, inference={self.inference!r}, trainer={self.trainer!r}, "
                f"models={len(self._slots)})")

    async def __aenter__(self) -> LocalBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the gateways and release the models. The backend cannot be used afterwards."""
        self._closed = True
        for slot in self._slots.values():
            if slot.gateway is not None:
                await slot.gateway.aclose()
            await slot.engine.aclose()
        self._slots.clear()

    # -- the Backend contract (called by TrainableModel) ----------------------------------------------

    def model_dir(self, model: ModelSpec) -> Path:
        return self.path / model.project / "models" / model.name

    async def register(self, model: ModelSpec) -> int:
        self._check_open()
        key = (model.project, model.name)
        if key in self._slots:
            raise LifecycleError(f"a model named {model.name!r} in project {model.project!r} is already "
                                 "registered with this backend")
        slot = await self._load(model)
        try:
            if self.serve:
                slot.gateway = await self._start_gateway(model, slot)
        except BaseException:
            await slot.engine.aclose()
            raise
        slot.ready.set()
        self._slots[key] = slot
        return slot.step

    def base_url(self, model: ModelSpec) -> str:
        return self._gateway(model).base_url

    def api_key(self, model: ModelSpec) -> str | None:
        return self._gateway(model).settings.api_key

    def rollout_base_url(self, model: ModelSpec, rollout_id: str) -> str:
        return self._gateway(model).rollout_base_url(rollout_id)

    def rollout_records(self, model: ModelSpec, rollout_id: str) -> list[ExchangeRecord]:
        return self._gateway(model).records.for_rollout(rollout_id)

    def rollout_status(self, model: ModelSpec, rollout_id: str) -> RolloutStatus:
        return self._gateway(model).rollout_status(rollout_id)

    async def train(self, model: ModelSpec, groups: Sequence[TrajectoryGroup], config: TrainConfig, *,
                    progress: Callable[[int, int], None] | None = None) -> TrainResult:
        """The contract's ``train``; ``progress(done, total)``, when given, is called from the training thread
        as micro-batches finish (``art-core serve`` streams it to its client), in place of the progress bar."""
        from ..training.trainer import check_config

        slot = self._slot(model)
        check_config(config)  # a bad loss option fails here, before the gateway pauses or anything is written
        async with slot.stepping:
            slot.ready.clear()
            try:
                return await self._step(slot, list(groups), config, progress)
            finally:
                slot.ready.set()

    async def _step(self, slot: _Slot, groups: list[TrajectoryGroup], config: TrainConfig,
                    report: Callable[[int, int], None] | None) -> TrainResult:
        # 1. pause: requests wait (they do not fail); the engine drains and, on a shared GPU, sleeps
        await self._pause(slot)

        # 2. trajectories to disk, one GRPO step, the checkpoint (a worker thread: the loop keeps serving I/O)
        try:
            metrics, checkpoint = await TRAINING.run(self._with_threads,
                                                     lambda: self._train_sync(slot, groups, config, report))
        except BaseException:
            if slot.error is None:  # the step was not applied: serve on as before
                await self._resume(slot)
            raise

        # 3. publish: the engine takes the new checkpoint; on failure the gateway stays paused
        failure: BaseException | None = None
        if checkpoint is not None:
            started = time.perf_counter()
            try:
                await slot.serving.publish(checkpoint, slot.step)
            except Exception as exc:
                failure = exc
                metrics["adapter_load_error"] = str(exc)
            metrics["seconds_adapter_load"] = time.perf_counter() - started
        append_history(slot.model_dir,
                        {"step": slot.step, "time": time.time(), **metrics, **trace_links(groups)})
        if failure is not None:
            slot.error = failure
            raise EngineError(f"checkpoint {slot.step:04d} was trained and written to {checkpoint}, but the "
                              f"{self.inference} engine could not serve it, so the gateway stays paused (held "
                              f"requests wait; none is served by an older step). The step's trajectories are in "
                              f"{slot.model_dir / 'trajectories'}. Cause: {failure}") from failure

        # 4. resume: the gateway checks the engine serves slot.step, then releases held requests
        await self._resume(slot)
        slot.error = None
        return TrainResult(metrics=metrics, step=slot.step)

    async def _pause(self, slot: _Slot) -> None:
        if slot.gateway is None:
            await slot.engine.pause()
        elif slot.gateway.control.state == "serving":  # not after a failed publish: it is paused already
            await slot.gateway.pause_for_training()

    async def _resume(self, slot: _Slot) -> None:
        if slot.gateway is not None:
            await slot.gateway.resume_after_training(slot.step)
            return
        if slot.engine.adapter_step != slot.step:
            raise EngineError(f"engine serves adapter {slot.engine.adapter_step}, expected {slot.step}: checkpoint "
                              f"{slot.step:04d} was not loaded")
        await slot.engine.resume()

    async def sample(self, model: ModelSpec, messages: Sequence[dict[str, Any]], *, n: int, max_tokens: int,
                     temperature: float, tools: list[dict[str, Any]] | None, seed: int | None) -> list[Trajectory]:
        slot = self._slot(model)
        messages = list(messages)
        tokenizer = slot.engine.tokenizer
        prompt = render_chat(tokenizer, messages, tools)
        await slot.ready.wait()  # a step in progress: sample the checkpoint it writes
        if slot.error is not None:
            raise EngineError(f"model {model.name!r}: the engine does not serve checkpoint {slot.step:04d} "
                              f"({slot.error}); train another step once the cause is fixed") from slot.error
        # Through the engine's queue, like every gateway request: one decode loop owns the module.
        completions = await slot.engine.generate(prompt, SamplingParams(n=n, max_tokens=max_tokens,
                                                                        temperature=temperature, seed=seed))
        return sampled_trajectories(tokenizer, messages, tools, prompt, completions)

    async def checkpoints(self, model: ModelSpec) -> list[int]:
        from ..training.checkpoints import list_checkpoints

        self._check_open()
        return [c.step for c in list_checkpoints(self.model_dir(model))]

    async def delete_checkpoints(self, model: ModelSpec, steps: Sequence[int]) -> list[int]:
        from ..training.checkpoints import delete_checkpoints

        slot = self._slot(model)
        return delete_checkpoints(slot.model_dir, steps, keep=slot.step)

    async def history(self, model: ModelSpec) -> list[dict[str, Any]]:
        self._check_open()
        return read_history(self.model_dir(model))

    # -- serving ----------------------------------------------------------------------------------------

    async def _start_gateway(self, model: ModelSpec, slot: _Slot) -> Gateway:
        try:
            from ..gateway import Gateway, GatewaySettings, RecordStore
        except ImportError as exc:
            raise ConfigError(f"serving needs the gateway's dependencies ({exc.name} is missing): "
                              "pip install 'art-core[serve]', or LocalBackend(serve=False)") from exc
        base_name = Path(str(model.base_model)).name  # a folder path is served under its last component
        settings = GatewaySettings(model_name=model.name, base_model_name=base_name,
                                   records_path=slot.model_dir / "records.jsonl", **self._gateway_options)
        gateway = Gateway(slot.engine, settings, RecordStore(settings.records_path))
        if self.gateway_mount is not None:
            return gateway.attach(self.gateway_mount(model))
        return await gateway.start()

    def gateway(self, model: ModelSpec) -> Gateway:
        """The model's running gateway (its ``app``, ``records``, URLs).

        Raises:
            LifecycleError: the model is not registered, or this backend was made with ``serve=False``.
        """
        return self._gateway(model)

    def _gateway(self, model: ModelSpec) -> Gateway:
        gateway = self._slot(model).gateway
        if gateway is None:
            raise LifecycleError("this LocalBackend was created with serve=False: it runs no gateway")
        return gateway

    # -- work done in a worker thread -----------------------------------------------------------------

    async def _load(self, model: ModelSpec) -> _Slot:
        import torch

        from ..models import resolve_base_model
        from ..training.checkpoints import latest_checkpoint
        from ..training.trainer import GRPOTrainer

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        base_dir = resolve_base_model(model.base_model)
        model_dir = self.model_dir(model)
        latest = latest_checkpoint(model_dir)
        adapter_dir = latest.path if latest else None

        def load_trainer() -> GRPOTrainer:
            policy, tokenizer = self._trainer.load(base_dir, model.lora, device, adapter_dir)
            trainer = GRPOTrainer(policy, tokenizer, share_prefix=self._trainer.share_prefix)
            if latest:
                trainer.load_optimizer_state(latest.path)
            return trainer

        trainer = await TRAINING.run(self._with_threads, load_trainer)
        step = latest.step if latest else 0
        serving = await self._inference.start(EngineContext(
            spec=model, base_dir=base_dir, policy=trainer.model, tokenizer=trainer.tokenizer, step=step,
            adapter_dir=adapter_dir, trainer_device=device, inference_device=self.inference_device or device,
            trainer_shares=self._trainer.shares_with_engine, vllm=self.vllm, log_dir=model_dir / "logs",
            transformers=self.transformers))
        return _Slot(trainer, serving, model_dir, step)

    def _train_sync(self, slot: _Slot, groups: list[TrajectoryGroup], config: TrainConfig,
                    report: Callable[[int, int], None] | None = None) -> tuple[dict[str, Any], Path | None]:
        """Trajectories to disk, one step, the checkpoint. Returns the metrics and the new checkpoint (or None)."""
        from ..training.checkpoints import write_checkpoint

        next_step = slot.step + 1
        # Everything the step learns from is on disk before it starts.
        write_groups_jsonl(trajectories_path(slot.model_dir, next_step), groups)
        with progress_bar(f"training step {next_step}", enabled=self.show_progress and report is None) as bar:
            metrics: dict[str, Any] = dict(slot.trainer.train_step(groups, config, progress=report or bar))
        if not metrics.get("trained"):
            return metrics, None
        checkpoint = write_checkpoint(slot.model_dir, next_step, slot.trainer.save,
                                      metadata={"loss": config.loss, "reward_mean": metrics["reward_mean"]})
        slot.step = next_step
        return metrics, checkpoint

    # -- helpers --------------------------------------------------------------------------------------

    def _slot(self, model: ModelSpec) -> _Slot:
        self._check_open()
        slot = self._slots.get((model.project, model.name))
        if slot is None:
            raise LifecycleError(f"model {model.name!r} is not registered with this backend")
        return slot

    def _check_open(self) -> None:
        if self._closed:
            raise LifecycleError("this LocalBackend is closed; create a new one")

    def _with_threads(self, fn: Callable[[], T]) -> T:
        with torch_threads(self.num_threads):  # scoped: restored after, also when two models step at once
            return fn()
