"""art-core: trajectory types, base models, the GRPO trainer on LoRA, and backends.

    TrainableModel --Backend--> LocalBackend | RayBackend | RemoteBackend (-> art-core serve -> Local or Ray)
    adapters (art_plugins) --GatewayAccess--> the model's gateway: URLs, key, async rollout records
    Local and Ray --> backends/_steps.StepRunner: one step path (groups to disk, pause, train, checkpoint,
                      publish, history, resume); each supplies only how it trains and how it publishes

Importing this package does not import torch: the training stack loads when a backend first needs it.
"""

from typing import TYPE_CHECKING, Any

from .backends import Backend, GatewayAccess, LocalBackend, ModelSpec, RayBackend, TrainResult, TransformersOptions, VLLMOptions
from .config import LoraSettings, SFTConfig, TrainConfig
from .errors import (
    ArtError,
    BaseModelNotFoundError,
    CheckpointError,
    ConfigError,
    JudgeError,
    LifecycleError,
    ModelNotRegisteredError,
    RewardError,
    RolloutError,
    ServerError,
    ServerUnavailableError,
    TrainingError,
    TrajectoryError,
)
from .model import TrainableModel
from .pipeline import PipelineReport, StepReport, pipeline
from .rewards import JudgeUsage, ruler_score_group, score_group
from .types import (
    CallRecord,
    History,
    Message,
    ToolCall,
    Trajectory,
    TrajectoryGroup,
    read_groups_jsonl,
    write_groups_jsonl,
)

if TYPE_CHECKING:
    from .backends.remote import RemoteBackend

__version__ = "0.1.0"

__all__ = [
    "ArtError",
    "Backend",
    "BaseModelNotFoundError",
    "CallRecord",
    "CheckpointError",
    "ConfigError",
    "GatewayAccess",
    "History",
    "JudgeError",
    "JudgeUsage",
    "LifecycleError",
    "LocalBackend",
    "LoraSettings",
    "Message",
    "ModelNotRegisteredError",
    "ModelSpec",
    "PipelineReport",
    "RayBackend",
    "RemoteBackend",
    "RewardError",
    "RolloutError",
    "SFTConfig",
    "ServerError",
    "ServerUnavailableError",
    "StepReport",
    "ToolCall",
    "TrainConfig",
    "TrainResult",
    "TrainableModel",
    "TrainingError",
    "Trajectory",
    "TrajectoryError",
    "TrajectoryGroup",
    "TransformersOptions",
    "VLLMOptions",
    "pipeline",
    "read_groups_jsonl",
    "ruler_score_group",
    "score_group",
    "write_groups_jsonl",
]


def __getattr__(name: str) -> Any:
    if name == "RemoteBackend":  # lazily: it needs httpx (art-core[serve]); see art_core.backends
        from . import backends

        return backends.RemoteBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
