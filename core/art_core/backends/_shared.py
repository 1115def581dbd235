"""What every in-process backend (``LocalBackend``, ``RayBackend``) does the same way.

- ``ServesModels``: the contract's methods that read the backend's ``ModelTable`` (``_tables.py``) (the adapters' ``GatewayAccess``, ``train``
  through the model's ``StepRunner``, ``sample``, checkpoints, history); a backend adds ``register``, ``aclose``
  and how it trains and publishes (``_steps.StepWork``).
- ``sample``: the chat is rendered through the gateway's message conversion (``art_core.messages``), so a
  conversation gives the same prompt tokens whichever way it reaches the model, and each reply becomes a
  trajectory with its token-exact call record.
- The on-disk layout under ``<model_dir>``: ``trajectories/NNNN.jsonl`` (never overwritten) and ``history.jsonl``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..config import SFTConfig, TrainConfig
from ..engines.base import EngineOutput, SamplingParams
from ..errors import LifecycleError
from ..messages import template_messages
from ..types import CallRecord, Message, Trajectory, TrajectoryGroup, chat_messages
from ._tables import ModelTable
from .base import ModelSpec, Progress, TrainResult

if TYPE_CHECKING:
    from ..gateway import Gateway
    from ..gateway.records import ExchangeRecord
    from ..wire import RolloutStatus
    from ._steps import StepRunner

__all__ = ["ServesModels", "append_history", "read_history", "render_chat", "sampled_trajectories",
           "trajectories_path"]


class Slot(Protocol):
    """What ``ServesModels`` reads of a registered model."""

    steps: StepRunner
    gateway: Gateway | None

    @property
    def engine(self) -> Any:
        """The ``Engine`` behind the gateway (a ``ReplicaRouter`` on Ray)."""
        ...


class ServesModels:
    """The contract's methods of a backend whose models are in a ``ModelTable`` (``self._models``).

    A mixin rather than a helper each backend forwards to: the methods are the same on Local and Ray, and
    forwarding them one by one would be the copy this replaces. A backend adds ``register`` and ``aclose``.
    """

    _models: ModelTable[Any]

    def model_dir(self, model: ModelSpec) -> Path:
        return self._models.folder(model)

    @property
    def _slots(self) -> dict[tuple[str, str], Any]:  # tests reach the registered models' engines through it
        return self._models.slots

    def _slot(self, model: ModelSpec) -> Any:
        return self._models.get(model)

    def gateway(self, model: ModelSpec) -> Gateway:
        """The model's running gateway (its ``app``, ``records``, URLs); ``art-core serve`` mounts its app.

        Raises:
            ModelNotRegisteredError: the model is not registered.
            LifecycleError: this backend is closed, or runs no gateway (``LocalBackend(serve=False)``).
        """
        gateway = self._models.get(model).gateway
        if gateway is None:
            raise LifecycleError(f"this {self._models.owner} was created with serve=False: it runs no gateway")
        return gateway  # type: ignore[no-any-return]

    def current_step(self, model: ModelSpec) -> int:
        """The latest checkpoint written for the model (the one served, unless publishing it failed)."""
        return self._models.get(model).steps.step  # type: ignore[no-any-return]

    # -- GatewayAccess: what adapters need -----------------------------------------------------------

    def base_url(self, model: ModelSpec) -> str:
        return self.gateway(model).base_url

    def api_key(self, model: ModelSpec) -> str | None:
        return self.gateway(model).settings.api_key

    def rollout_base_url(self, model: ModelSpec, rollout_id: str) -> str:
        return self.gateway(model).rollout_base_url(rollout_id)

    async def rollout_records(self, model: ModelSpec, rollout_id: str) -> list[ExchangeRecord]:
        return self.gateway(model).records.for_rollout(rollout_id)

    async def rollout_status(self, model: ModelSpec, rollout_id: str) -> RolloutStatus:
        return self.gateway(model).rollout_status(rollout_id)

    # -- training and sampling -------------------------------------------------------------------------

    async def train(self, model: ModelSpec, groups: Sequence[TrajectoryGroup], config: TrainConfig | SFTConfig, *,
                    progress: Progress | None = None, train_id: str | None = None) -> TrainResult:
        """The contract's ``train`` (see ``_steps``). ``progress(done, total)``, when given, is called as
        micro-batches finish (``art-core serve`` streams it to its client). ``train_id`` (``art-core serve``'s
        train call) is kept in the checkpoint, with the metrics (``checkpoints.checkpoint_of_train_call``)."""
        from ..training.trainer import check_config

        slot = self._models.get(model)
        check_config(config)  # a bad loss option fails here, before the gateway pauses or anything is written
        return (await slot.steps.run(groups, config, progress, train_id=train_id)).result  # type: ignore[no-any-return]

    async def prepare_training(self, model: ModelSpec, config: TrainConfig | SFTConfig) -> None:
        """``TrainableModel.prepare_training``: the trainer makes what a first step under ``config`` would make at
        its start (``StepWork.prepare``); serving goes on."""
        await self._models.get(model).steps.work.prepare(config)

    async def sample(self, model: ModelSpec, messages: Sequence[dict[str, Any]], *, n: int, max_tokens: int,
                     temperature: float, tools: list[dict[str, Any]] | None, seed: int | None) -> list[Trajectory]:
        slot = self._models.get(model)
        messages = list(messages)
        chat = chat_messages(messages, where="sample()")  # a server's client may send anything: a 400, not a 500
        tokenizer = slot.engine.tokenizer
        prompt = render_chat(tokenizer, messages, tools)
        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, seed=seed)
        async with slot.steps.serving():  # a step in progress: sample the checkpoint it writes
            # Through the engine's queue, like every gateway request: one decode loop owns the module.
            completions = await slot.engine.generate(prompt, params)
        return sampled_trajectories(tokenizer, chat, tools, prompt, completions)

    # -- the model's folder ------------------------------------------------------------------------------

    async def checkpoints(self, model: ModelSpec) -> list[int]:
        from ..training.checkpoints import list_checkpoints

        self._models.check_open()
        return [c.step for c in list_checkpoints(self.model_dir(model))]

    async def delete_checkpoints(self, model: ModelSpec, steps: Sequence[int]) -> list[int]:
        from ..training.checkpoints import delete_checkpoints

        slot = self._models.get(model)
        return delete_checkpoints(self.model_dir(model), steps, keep=slot.steps.step)

    async def history(self, model: ModelSpec) -> list[dict[str, Any]]:
        self._models.check_open()
        return read_history(self.model_dir(model))


def render_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """The prompt token ids of ``messages`` (and ``tools``), ready for the assistant's turn."""
    prompt = tokenizer.apply_chat_template(template_messages(list(messages)), tools=tools, add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    return list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)


def sampled_trajectories(tokenizer: Any, chat: Sequence[Message], tools: list[dict[str, Any]] | None,
                         prompt: list[int], completions: Sequence[EngineOutput]) -> list[Trajectory]:
    """One trajectory per completion: the chat (checked by ``chat_messages``), the reply, and the call's
    token-exact record."""
    return [Trajectory(
        messages=[*chat, Message(role="assistant", content=tokenizer.decode(c.token_ids, skip_special_tokens=True))],
        tools=tools or [],
        calls=[CallRecord(prompt_token_ids=prompt, completion_token_ids=c.token_ids, logprobs=c.logprobs,
                          adapter_step=c.adapter_step, finish_reason=c.finish_reason)],
    ) for c in completions]


def trajectories_path(model_dir: Path, step: int) -> Path:
    """``trajectories/NNNN.jsonl``, or ``NNNN-2.jsonl``... when an earlier attempt at the same step left one."""
    folder, stem = model_dir / "trajectories", f"{step:04d}"
    path, k = folder / f"{stem}.jsonl", 2
    while path.exists():
        path, k = folder / f"{stem}-{k}.jsonl", k + 1
    return path


def read_history(model_dir: Path) -> list[dict[str, Any]]:
    """The rows of ``history.jsonl`` (empty when no step was run)."""
    path = model_dir / "history.jsonl"
    if not path.is_file():
        return []
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def append_history(model_dir: Path, row: dict[str, Any]) -> None:
    """Append one step's row to ``history.jsonl``."""
    model_dir.mkdir(parents=True, exist_ok=True)
    with (model_dir / "history.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps(row, default=float) + "\n")
