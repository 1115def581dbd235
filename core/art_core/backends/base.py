"""The backend contract, split by role: what adapters need from the side that serves a model (``GatewayAccess``),
and what ``TrainableModel`` needs from the place it is trained (``Backend``, which serves it too).

``TrainableModel`` talks to a backend only through these Protocols, the way httpx's ``Client`` talks to a
``BaseTransport``: ``LocalBackend`` (this process), ``RemoteBackend`` (a client of ``art-core serve``) and
``RayBackend`` (a cluster) implement ``Backend``; a Ray rollout worker's ``GatewayView`` implements only
``GatewayAccess`` (``TrainableModel.attach``). A third-party one needs no subclassing.

    GatewayAccess    base_url, api_key, rollout_base_url           where an agent's calls go
                     async rollout_records, async rollout_status   what the gateway recorded (may be HTTP: async)
    Backend          + register, train (GRPO or SFT), sample,       the training side
                       model_dir,
                       checkpoints, delete_checkpoints, history, aclose

A backend keys everything by the model's ``(project, name)``; it receives ``model.spec``, a ``ModelSpec``
(plain data: name, project, base model, LoRA shape), never the ``TrainableModel`` object.
Users do not call these methods: ``TrainableModel`` does (``model.register(backend)``, ``model.train``...).

Step semantics every backend keeps (``backends/_steps.py`` is the one implementation the in-process ones share):
one step at a time per model (a second ``train`` waits for the first, it does not fail); a step is GRPO's
(``TrainConfig``) or supervised fine-tuning's (``SFTConfig``), and both kinds share the step counter, the
checkpoints and ``history.jsonl`` (its ``kind`` says which), so RL resumes on the adapter SFT wrote; the groups are on
disk before the step starts; a checkpoint the engine cannot serve leaves the gateway paused and ``train``
raising the engine's error (``sample`` raises it too) until a later step succeeds; ``sample`` waits while a
step runs and answers with the checkpoint it wrote.

Lifecycle: ``register`` once per model, then any calls, then ``aclose``; after ``aclose`` every call raises
``LifecycleError``; a call about a model that is not registered raises ``ModelNotRegisteredError``. Backends
are async context managers (``async with LocalBackend() as backend``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from .._names import check_name
from ..config import LoraSettings, SFTConfig, TrainConfig
from ..types import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from ..gateway.records import ExchangeRecord
    from ..wire import RolloutStatus

__all__ = ["Backend", "GatewayAccess", "ModelSpec", "Progress", "TrainResult"]


class ModelSpec(BaseModel):
    """The declarative part of a ``TrainableModel``: what a backend needs to load and place it.

    It is plain data (JSON-serialisable), so a remote backend can send it over the wire.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    """The model's name: its folder under ``<root>/<project>/models/`` and the name the gateway serves."""
    project: str
    """Groups models on disk."""

    @field_validator("name", "project")
    @classmethod
    def _folder_name(cls, value: str, info: ValidationInfo) -> str:
        # Checked here too, not only by TrainableModel: a spec arriving over the wire (art-core serve) names
        # folders on the server, which must stay under its --path.
        return check_name(f"{'model' if info.field_name == 'name' else 'project'} name", value)
    base_model: str
    """A registered base model name or a local Hugging Face folder (a path on the backend's machine)."""
    lora: LoraSettings
    """The adapter's shape, fixed for the model's life."""


class TrainResult(BaseModel):
    """What one ``Backend.train`` call returns."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    metrics: dict[str, Any]
    """The step's metrics, as appended to ``history.jsonl`` (``trained`` says whether a checkpoint was written)."""
    step: int
    """The step served after the call: the new checkpoint's number, or the old one if nothing was trained."""


Progress: TypeAlias = Callable[[int, int], None]
"""``progress(done, total)``: how far a training step is, in units the backend chooses (micro-batches on the
in-process trainer); called at least once, when the step ends. It may be called from another thread."""


@runtime_checkable
class GatewayAccess(Protocol):
    """What adapters need from the side that serves a model: where its calls go, and what the gateway recorded.

    The records are read while rollouts run, often over HTTP (``RemoteBackend``, a Ray rollout worker), so
    reading them is a coroutine: it never blocks the event loop the other rollouts of a group run on.
    """

    def base_url(self, model: ModelSpec) -> str:
        """The gateway's OpenAI base URL for the model (``http://HOST:PORT/v1``)."""
        ...

    def api_key(self, model: ModelSpec) -> str | None:
        """The bearer token the gateway wants; None when it needs none."""
        ...

    def rollout_base_url(self, model: ModelSpec, rollout_id: str) -> str:
        """A base URL whose calls the gateway records under ``rollout_id``."""
        ...

    async def rollout_records(self, model: ModelSpec, rollout_id: str) -> list[ExchangeRecord]:
        """The gateway's records of a rollout's calls, oldest first."""
        ...

    async def rollout_status(self, model: ModelSpec, rollout_id: str) -> RolloutStatus:
        """What the gateway knows of a rollout's calls beyond their records: those received and not answered yet."""
        ...


@runtime_checkable
class Backend(GatewayAccess, Protocol):
    """Where a ``TrainableModel`` is trained and served (it also gives the adapters' ``GatewayAccess``).

    Example, a backend that forwards to another one (each method is a plain call or coroutine)::

        class Logged:
            def __init__(self, inner: Backend) -> None:
                self.inner = inner

            async def train(self, model, groups, config, *, progress=None):
                print(f"training {model.name} on {len(groups)} groups")
                return await self.inner.train(model, groups, config, progress=progress)

            ...  # every other method forwards unchanged
    """

    async def register(self, model: ModelSpec) -> int:
        """Load the base model with the latest complete checkpoint and start serving it.

        Returns:
            The step served (0: the base model, no checkpoint yet).

        Raises:
            LifecycleError: a model of that project and name is already registered, or the backend is closed.
            BaseModelNotFoundError: the base model cannot be found.
        """
        ...

    async def train(self, model: ModelSpec, groups: Sequence[TrajectoryGroup], config: TrainConfig | SFTConfig, *,
                    progress: Progress | None = None) -> TrainResult:
        """Persist ``groups``, run one step, write the checkpoint, and serve it before returning.

        Args:
            config: ``TrainConfig``: one GRPO step. ``SFTConfig``: one supervised fine-tuning step (``epochs``
                passes in ``batch_size`` optimizer steps, one checkpoint at the end); every trajectory is
                trained on, whatever its reward. A remote backend sends either over the wire (``kind`` tells
                them apart).
            progress: called as the step advances (see ``Progress``); None: the backend's own display, if any.
        """
        ...

    async def sample(self, model: ModelSpec, messages: Sequence[dict[str, Any]], *, n: int, max_tokens: int,
                     temperature: float, tools: list[dict[str, Any]] | None,
                     seed: int | None) -> list[Trajectory]:
        """``n`` replies to a chat, each a ``Trajectory`` with its token-exact call record."""
        ...

    def model_dir(self, model: ModelSpec) -> Path:
        """``<root>/<project>/models/<name>`` on the machine that trains (it may not be this one)."""
        ...

    async def checkpoints(self, model: ModelSpec) -> list[int]:
        """The steps of the complete checkpoints on disk, oldest first."""
        ...

    async def delete_checkpoints(self, model: ModelSpec, steps: Sequence[int]) -> list[int]:
        """Delete these checkpoints (never the one being served); returns the steps deleted."""
        ...

    async def history(self, model: ModelSpec) -> list[dict[str, Any]]:
        """The rows of ``history.jsonl``: one per train call, with its metrics and ``kind`` (``"grpo"``, ``"sft"``)."""
        ...

    async def aclose(self) -> None:
        """Stop serving and release everything; the backend cannot be used afterwards."""
        ...
