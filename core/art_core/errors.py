"""Every error art-core raises on purpose.

    ArtError
    ├── ConfigError              a setting or argument is wrong; nothing ran
    │   └── BaseModelNotFoundError   a base model name or path cannot be resolved
    ├── TrajectoryError          a trajectory or group cannot be trained on as given
    ├── TrainingError            training failed while running
    ├── CheckpointError          a checkpoint is missing, half-written or does not fit the model
    ├── EngineError              an inference engine failed to start, answer or load an adapter
    │   └── ConstraintError          a request's JSON schema or grammar cannot be enforced (the gateway: 400)
    ├── LifecycleError           an object was used in the wrong state (register twice, use after close)
    │   └── ModelNotRegisteredError  a backend (or server) was asked about a model it has not registered
    ├── RewardError              a group could not be scored (empty group, a reward function failed)
    │   └── JudgeError           an LLM judge was unreachable, or its answer stayed malformed after repairs
    ├── RolloutError             rollouts keep failing: the pipeline stopped (the last failure is the cause)
    └── ServerError              the training server (``art-core serve``) failed a call in a way no class above names
        └── ServerUnavailableError   the server cannot be reached (down, restarting, wrong URL)

Each message says what happened, the value involved, and how to fix it. Errors from libraries
(torch, transformers, peft, litellm) are re-raised as one of these with the original kept as ``__cause__``.
"""

from __future__ import annotations

__all__ = [
    "ArtError",
    "BaseModelNotFoundError",
    "CheckpointError",
    "ConfigError",
    "ConstraintError",
    "EngineError",
    "JudgeError",
    "LifecycleError",
    "ModelNotRegisteredError",
    "RewardError",
    "RolloutError",
    "ServerError",
    "ServerUnavailableError",
    "TrainingError",
    "TrajectoryError",
]


class ArtError(Exception):
    """Root of every error art-core raises on purpose."""


class ConfigError(ArtError, ValueError):
    """A setting or argument is wrong; nothing ran."""


class BaseModelNotFoundError(ConfigError, FileNotFoundError):
    """A base model name or path cannot be resolved to a local model directory."""


class TrajectoryError(ArtError, ValueError):
    """A trajectory or group cannot be trained on as given (the message names which one)."""


class TrainingError(ArtError, RuntimeError):
    """Training failed while running."""


class CheckpointError(ArtError, RuntimeError):
    """A checkpoint is missing, half-written, or does not fit the model."""


class EngineError(ArtError, RuntimeError):
    """An inference engine failed to start, answer a request, or load an adapter (the message says which)."""


class ConstraintError(EngineError):
    """The request's output constraint (JSON schema or grammar) is one the engine cannot enforce."""


class LifecycleError(ArtError, RuntimeError):
    """An object was used in the wrong state: registered twice, or used after close."""


class ModelNotRegisteredError(LifecycleError):
    """A backend, or the server behind ``RemoteBackend``, was asked about a model it has not registered (a server
    that restarted has lost its registrations: ``RemoteBackend`` registers again on this error)."""


class RewardError(ArtError, RuntimeError):
    """A group could not be scored: it is empty, or a reward function failed or returned no finite number."""


class JudgeError(RewardError):
    """An LLM judge was unreachable, refused the request, or answered malformed output even after repairs."""


class RolloutError(ArtError, RuntimeError):
    """Rollouts keep failing, none succeeding in between: ``pipeline`` stopped rather than retry forever (the last
    failure is the ``__cause__``)."""


class ServerError(ArtError, RuntimeError):
    """The training server failed a call with an error no other class names (its type is in the message)."""


class ServerUnavailableError(ServerError, ConnectionError):
    """The training server cannot be reached: it is down or restarting, or the URL is wrong (the message names it)."""
