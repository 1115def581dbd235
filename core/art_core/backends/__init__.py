"""Where training runs. ``Backend`` is the contract ``TrainableModel`` talks to; ``LocalBackend`` implements it
in this process."""

from .base import Backend, ModelSpec, TrainResult
from .local import LocalBackend

__all__ = ["Backend", "LocalBackend", "ModelSpec", "TrainResult"]
