"""The OpenAI-compatible gateway: serves the model being trained and records every exchange token-exactly.

    async with Gateway(engine, GatewaySettings(model_name="agent")) as gateway:
        client = openai.AsyncOpenAI(base_url=gateway.rollout_base_url("run-1"), api_key="unused")
        ...
        calls = [r.to_call_record() for r in gateway.records.for_rollout("run-1")]

The HTTP parts need the ``serve`` extra (``pip install 'art-core[serve]'``); they are imported on first
use, so ``art_core.gateway.tool_calls`` works without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app
    from .records import ExchangeRecord, RecordStore
    from .server import Gateway
    from .settings import GatewaySettings

__all__ = ["ExchangeRecord", "Gateway", "GatewaySettings", "RecordStore", "create_app"]

_WHERE = {
    "ExchangeRecord": "records",
    "Gateway": "server",
    "GatewaySettings": "settings",
    "RecordStore": "records",
    "create_app": "app",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(f".{_WHERE[name]}", __name__)
    except ImportError as exc:
        raise ImportError(
            f"art_core.gateway.{name} needs the gateway's dependencies ({exc.name} is missing): "
            "pip install 'art-core[serve]'",
            name=exc.name,
        ) from exc
    return getattr(module, name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
