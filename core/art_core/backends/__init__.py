"""Where training runs. ``Backend`` is the contract ``TrainableModel`` talks to; ``LocalBackend`` implements it
in this process, ``RemoteBackend`` on an ``art-core serve`` server (it needs ``art-core[serve]``, for httpx),
``RayBackend`` on a Ray cluster (``art-core[distributed]``; importing it does not import Ray). ``LocalBackend``
takes a choice of inference engine and trainer (``VLLMOptions`` configures vLLM, ``TransformersOptions`` the
in-process transformers engine)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._engines import TransformersOptions, VLLMOptions
from .base import Backend, GatewayAccess, ModelSpec, TrainResult
from .local import LocalBackend
from .ray import RayBackend

if TYPE_CHECKING:
    from .remote import RemoteBackend

__all__ = ["Backend", "GatewayAccess", "LocalBackend", "ModelSpec", "RayBackend", "RemoteBackend", "TrainResult", "TransformersOptions",
           "VLLMOptions"]


def __getattr__(name: str) -> Any:
    # Imported on first use: httpx comes with the serve extra, and `import art_core` must work without it.
    if name == "RemoteBackend":
        try:
            from .remote import RemoteBackend
        except ImportError as exc:
            raise ImportError(f"RemoteBackend needs httpx ({exc.name} is missing): pip install 'art-core[serve]'",
                              name=exc.name) from exc
        return RemoteBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
