"""``LocalBackend``: trains and samples in this process, on CPU or the local GPU.

Per model it keeps one PEFT model that the trainer and the engine share, serves it through an
OpenAI-compatible gateway on 127.0.0.1 (``model.base_url``), and owns the on-disk layout
``<path>/<project>/models/<name>/{checkpoints/NNNN, trajectories/, records.jsonl, history.jsonl}``.
A training step pauses the gateway (requests wait, they do not fail), trains the shared weights, writes
the checkpoint, and resumes only once the engine reports the new step.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..config import TrainConfig
from ..engines.base import SamplingParams
from ..errors import ConfigError, LifecycleError
from ..messages import template_messages
from ..types import CallRecord, Message, Trajectory, TrajectoryGroup, trace_links, write_groups_jsonl

from ._progress import progress_bar
from .base import ModelSpec, TrainResult

if TYPE_CHECKING:
    from ..engines.transformers import TransformersEngine
    from ..gateway import Gateway
    from ..gateway.records import ExchangeRecord
    from ..training.trainer import GRPOTrainer

__all__ = ["LocalBackend"]

T = TypeVar("T")


@dataclass
class _Slot:
    trainer: GRPOTrainer
    engine: TransformersEngine
    model_dir: Path
    step: int
    lock: threading.Lock
    gateway: Gateway | None = None


class LocalBackend:
    """Runs training and sampling in this process; implements ``art_core.backends.Backend``.

    Args:
        path: root folder of projects (checkpoints, trajectories, history).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; default: CUDA when available, else CPU.
        num_threads: torch threads while this backend computes (restored after each call); default:
            leave torch's setting. On a small shared CPU, fewer threads than cores avoids collapse.
        show_progress: show a progress bar during training steps.
        serve: start an OpenAI-compatible gateway for each registered model (needs ``art-core[serve]``).
        gateway_mount: serve each gateway inside the caller's ASGI app rather than on a loopback port of its
            own: called with the model's spec, it returns the URL the caller serves ``gateway(model).app`` at
            (``art-core serve`` puts every model's gateway on its one port this way). None: own ports.
    """

    def __init__(self, *, path: str | Path = ".art", device: str | None = None,
                 num_threads: int | None = None, show_progress: bool = True, serve: bool = True,
                 gateway_mount: Callable[[ModelSpec], str] | None = None) -> None:
        self.serve = serve
        self.gateway_mount = gateway_mount
        self.path = Path(path)
        self.device = device
        self.num_threads = num_threads
        self.show_progress = show_progress
        self._slots: dict[tuple[str, str], _Slot] = {}
        self._closed = False

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
        slot = await asyncio.to_thread(self._with_threads, lambda: self._load(model))
        if self.serve:
            slot.gateway = await self._start_gateway(model, slot)
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

    async def train(self, model: ModelSpec, groups: Sequence[TrajectoryGroup], config: TrainConfig, *,
                    progress: Callable[[int, int], None] | None = None) -> TrainResult:
        """The contract's ``train``; ``progress(done, total)``, when given, is called from the training thread
        as micro-batches finish (``art-core serve`` streams it to its client), in place of the progress bar."""
        from ..training.trainer import check_config

        slot = self._slot(model)
        check_config(config)  # a bad loss option fails here, before the gateway pauses or anything is written
        if slot.gateway is not None:
            await slot.gateway.pause_for_training()  # in-flight requests finish; new ones wait
        try:
            metrics, step = await asyncio.to_thread(self._with_threads,
                                                    lambda: self._train_sync(slot, list(groups), config, progress))
            return TrainResult(metrics=metrics, step=step)
        finally:
            if slot.gateway is not None:
                # Checks that the engine serves the step just written; requests stay held if not.
                await slot.gateway.resume_after_training(slot.step)

    async def sample(self, model: ModelSpec, messages: Sequence[dict[str, Any]], *, n: int, max_tokens: int,
                     temperature: float, tools: list[dict[str, Any]] | None, seed: int | None) -> list[Trajectory]:
        slot = self._slot(model)
        messages = list(messages)

        def run() -> list[Trajectory]:
            tokenizer = slot.engine.tokenizer
            # The gateway's conversion (art_core.messages), so a conversation renders the same prompt either way.
            prompt = tokenizer.apply_chat_template(template_messages(messages), tools=tools, add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)
            prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
            params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, seed=seed)
            with slot.lock:
                (completions,) = slot.engine.generate_batch([prompt], [params])
            return [Trajectory(
                messages=[*(Message.model_validate(m) for m in messages),
                          Message(role="assistant", content=tokenizer.decode(c.token_ids, skip_special_tokens=True))],
                tools=tools or [],
                calls=[CallRecord(prompt_token_ids=prompt, completion_token_ids=c.token_ids, logprobs=c.logprobs,
                                  adapter_step=c.adapter_step, finish_reason=c.finish_reason)],
            ) for c in completions]

        return await asyncio.to_thread(self._with_threads, run)

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
        return read_history(self.model_dir(model) / "history.jsonl")

    # -- serving ----------------------------------------------------------------------------------------

    async def _start_gateway(self, model: ModelSpec, slot: _Slot) -> Gateway:
        try:
            from ..gateway import Gateway, GatewaySettings, RecordStore
        except ImportError as exc:
            raise ConfigError(f"serving needs the gateway's dependencies ({exc.name} is missing): "
                              "pip install 'art-core[serve]', or LocalBackend(serve=False)") from exc
        base_name = Path(str(model.base_model)).name  # a folder path is served under its last component
        settings = GatewaySettings(model_name=model.name, base_model_name=base_name,
                                   records_path=slot.model_dir / "records.jsonl")
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

    def _load(self, model: ModelSpec) -> _Slot:
        import torch

        from ..engines.transformers import TransformersEngine
        from ..models import resolve_base_model
        from ..training.checkpoints import latest_checkpoint
        from ..training.trainer import GRPOTrainer, load_policy

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        base_dir = resolve_base_model(model.base_model)
        model_dir = self.model_dir(model)
        latest = latest_checkpoint(model_dir)
        policy, tokenizer = load_policy(base_dir, model.lora, device=device,
                                        adapter_dir=latest.path if latest else None)
        trainer = GRPOTrainer(policy, tokenizer)
        if latest:
            trainer.load_optimizer_state(latest.path)
        step = latest.step if latest else 0
        return _Slot(trainer, TransformersEngine(policy, tokenizer, adapter_step=step), model_dir, step,
                     threading.Lock())

    def _train_sync(self, slot: _Slot, groups: list[TrajectoryGroup], config: TrainConfig,
                    report: Callable[[int, int], None] | None = None) -> tuple[dict[str, float], int]:
        from ..training.checkpoints import write_checkpoint

        with slot.lock:  # inference waits for the step, then runs on the new adapter
            next_step = slot.step + 1
            # Everything the step learns from is on disk before it starts.
            write_groups_jsonl(_free_path(slot.model_dir / "trajectories", f"{next_step:04d}"), groups)
            with progress_bar(f"training step {next_step}", enabled=self.show_progress and report is None) as bar:
                metrics = slot.trainer.train_step(groups, config, progress=report or bar)
            if metrics.get("trained"):
                write_checkpoint(slot.model_dir, next_step, slot.trainer.save,
                                 metadata={"loss": config.loss, "reward_mean": metrics["reward_mean"]})
                slot.step = next_step
                slot.engine.mark_adapter_step(next_step)  # the engine shares the trained weights
            _append_history(slot.model_dir / "history.jsonl",
                             {"step": slot.step, "time": time.time(), **metrics, **trace_links(groups)})
            return metrics, slot.step

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
        if self.num_threads is None:
            return fn()
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(self.num_threads)
        try:
            return fn()
        finally:
            torch.set_num_threads(before)


def _free_path(folder: Path, stem: str) -> Path:
    """``folder/stem.jsonl``, or ``stem-2.jsonl``... when an earlier attempt at the same step left one."""
    path, k = folder / f"{stem}.jsonl", 2
    while path.exists():
        path, k = folder / f"{stem}-{k}.jsonl", k + 1
    return path


def read_history(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``history.jsonl`` (empty when no step was run)."""
    if not path.is_file():
        return []
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _append_history(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row, default=float) + "\n")
