"""Which model names the gateway answers to, and ``GET /v1/models``.

The engine serves one adapter at a time: the latest checkpoint. So the gateway accepts

- ``model_name`` (e.g. ``"agent"``): whatever checkpoint is served now;
- ``model_name@N``: only when N is the step served now (404 otherwise, naming the served step), so a
  client pinned to a checkpoint never silently gets another one;
- ``base_model_name``: only while no adapter is loaded (step 0); after the first training step it is a
  404 that says so, because serving the base model next to the adapter is not supported yet.

Names with path separators or ``..`` are refused with 400 (they could end up in file paths or logs).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends

from .errors import APIError
from .settings import GatewaySettings
from .state import GatewayState, get_state, rollout_scope

__all__ = ["check_model", "router", "served_models"]

router = APIRouter()

_STARTED = int(time.time())


def served_models(settings: GatewaySettings, step: int) -> list[str]:
    """The names ``/v1/models`` lists: the base model, the trained model and its pinned name."""
    return [settings.base_model_name, settings.model_name, f"{settings.model_name}@{step}"]


def check_model(requested: str, settings: GatewaySettings, step: int) -> None:
    """Accept ``requested`` if the engine's current adapter (``step``) can answer for it.

    Raises:
        APIError: 400 for a name with ``/``, ``\\`` or ``..``; 404 for a name not served now.
    """
    if "/" in requested or "\\" in requested or ".." in requested or "\x00" in requested:
        raise APIError(
            400, f"model name {requested[:140]!r} contains a path separator or '..': use {settings.model_name!r}",
            param="model", code="invalid_model",
        )
    name = settings.model_name
    if requested == name or requested == f"{name}@{step}":
        return
    if requested == settings.base_model_name:
        if step == 0:
            return
        raise APIError(
            404, f"model {requested!r} is not served: the engine serves one adapter at a time, now checkpoint "
            f"{step} of {name!r}; request {name!r} (or {name}@{step})", param="model", code="model_not_found",
        )
    if requested.startswith(f"{name}@"):
        raise APIError(
            404, f"model {requested!r} is not served: only the current checkpoint is, {name}@{step} "
            f"(also called {name!r})", param="model", code="model_not_found",
        )
    raise APIError(
        404, f"model {requested[:140]!r} does not exist here: this gateway serves {served_models(settings, step)}",
        param="model", code="model_not_found",
    )


def _model_object(model_id: str, settings: GatewaySettings) -> dict[str, Any]:
    root = settings.base_model_name
    return {"id": model_id, "object": "model", "created": _STARTED, "owned_by": "art-plugins", "root": root}


@router.get("/models")
async def list_models(
    state: GatewayState = Depends(get_state), _: str | None = Depends(rollout_scope)
) -> dict[str, Any]:
    """OpenAI's model list."""
    names = served_models(state.settings, state.engine.adapter_step)
    return {"object": "list", "data": [_model_object(n, state.settings) for n in names]}


@router.get("/models/{model}")
async def retrieve_model(
    model: str, state: GatewayState = Depends(get_state), _: str | None = Depends(rollout_scope)
) -> dict[str, Any]:
    """One model, or 404 when it is not served now."""
    check_model(model, state.settings, state.engine.adapter_step)
    return _model_object(model, state.settings)
