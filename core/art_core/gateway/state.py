"""What every route needs: the engine, settings, records, control and metrics, plus the rollout scope."""

from __future__ import annotations

import re
from dataclasses import dataclass

from fastapi import Request

from ..engines.base import Engine, routing_key
from .control import GatewayControl
from .errors import APIError
from .health import EngineHealth
from .metrics import GatewayMetrics
from .records import RecordStore
from .settings import GatewaySettings
from .chat_template import ChatTemplate
from .prompt_encoder import PromptEncoder
from .tokens import Detokenizer

from ..wire import (  # re-exported: the routes import them from here
    ADAPTER_STEP_HEADER,
    CALLER_HEADER,
    CALLER_MAX_CHARS,
    COMPLETION_TOKENS_HEADER,
    PROMPT_TOKENS_HEADER,
    REQUEST_ID_HEADER,
    ROLLOUT_ID_PATTERN,
    SEED_HEADER,
    call_headers,
    decode_caller,
)

__all__ = ["ADAPTER_STEP_HEADER", "CALLER_HEADER", "COMPLETION_TOKENS_HEADER", "PROMPT_TOKENS_HEADER",
           "REQUEST_ID_HEADER", "ROLLOUT_ID_PATTERN", "SEED_HEADER", "GatewayState", "call_headers", "check_rollout_id",
           "get_state", "request_scope", "request_seed", "rollout_scope"]

_CALLER = re.compile(r"^[^\x00-\x1f\x7f]+$")
_SEED_LIMIT = 2**63


@dataclass
class GatewayState:
    """Shared by all routes of one app (``app.state.gateway``)."""

    engine: Engine
    settings: GatewaySettings
    records: RecordStore
    control: GatewayControl
    metrics: GatewayMetrics
    detokenizer: Detokenizer
    prompt_encoder: PromptEncoder
    chat_template: ChatTemplate | None = None
    """Renders prompts with the per-tokenizer work done once (None: ``apply_chat_template`` each time)."""
    health: EngineHealth | None = None
    """The engine's last health report, refreshed in the background (``/health`` never waits on the engine)."""


async def get_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


def check_rollout_id(value: str, *, where: str) -> str:
    """``value`` if it is a valid rollout id, else a 400 naming where it came from."""
    if not ROLLOUT_ID_PATTERN.fullmatch(value) or value in (".", ".."):
        raise APIError(
            400, f"rollout id {value[:140]!r} (from {where}) is invalid: use 1-128 letters, digits, '.', '_' or '-'",
            param="rollout_id", code="invalid_rollout_id",
        )
    return value


def request_scope(request: Request) -> tuple[GatewayState, str | None, str | None]:
    """The app's state, the request's rollout id and its caller label, for the completion routes.

    Those routes call this directly rather than declaring three FastAPI dependencies: resolving them
    costs about 0.1 ms a request, a tenth of the gateway's own overhead (benchmark part (c)).

    Raises:
        APIError: 400 for an invalid rollout id or caller label (see ``rollout_scope`` and ``_caller_of``).
    """
    rollout_id = _rollout_of(request)
    routing_key.set(rollout_id)  # for engines with replicas: a rollout's calls go to one (the request's task only)
    return request.app.state.gateway, rollout_id, _caller_of(request)


async def rollout_scope(request: Request) -> str | None:
    """The rollout a request belongs to: ``/rollouts/{id}/v1/...`` or the ``X-Rollout-Id`` header (a dependency).

    Raises:
        APIError: 400 for an invalid id, or when path and header name different rollouts.
    """
    return _rollout_of(request)


def _rollout_of(request: Request) -> str | None:
    """The rollout a request belongs to: ``/rollouts/{id}/v1/...`` or the ``X-Rollout-Id`` header.

    Raises:
        APIError: 400 for an invalid id, or when path and header name different rollouts.
    """
    from_path = request.path_params.get("rollout_id")
    from_header = request.headers.get("x-rollout-id")
    if from_path is not None:
        check_rollout_id(from_path, where="the URL path")
    if from_header is not None:
        check_rollout_id(from_header, where="the X-Rollout-Id header")
    if from_path is not None and from_header is not None and from_path != from_header:
        raise APIError(
            400, f"the URL names rollout {from_path!r} but X-Rollout-Id says {from_header!r}: send one, or the "
            "same in both",
            param="rollout_id", code="invalid_rollout_id",
        )
    return from_path if from_path is not None else from_header


def request_seed(request: Request) -> int | None:
    """The ``X-Art-Seed`` header as an integer (None when absent).

    Raises:
        APIError: 400 when it is not a whole number from 0 to 2**63 - 1.
    """
    value = request.headers.get(SEED_HEADER)
    if value is None:
        return None
    seed = int(value) if value.isascii() and value.isdigit() and len(value) <= 19 else -1  # not "²": int() refuses it
    if not 0 <= seed < _SEED_LIMIT:
        raise APIError(400, f"the {SEED_HEADER} header {value[:40]!r} is invalid: send a whole number from 0 to "
                       f"{_SEED_LIMIT - 1}", param=SEED_HEADER, code="invalid_seed")
    return seed


def _caller_of(request: Request) -> str | None:
    """The ``X-Art-Caller`` header, decoded (``wire.decode_caller``): which part of the agent made the call.

    Raises:
        APIError: 400 when the header or the label it encodes is empty, holds control characters, or the label is
            longer than ``CALLER_MAX_CHARS`` (``wire.encode_caller`` makes a valid value of any label).
    """
    value = request.headers.get(CALLER_HEADER)
    if value is None:
        return None
    label = decode_caller(value) if _CALLER.fullmatch(value) else ""
    if not _CALLER.fullmatch(label) or len(label) > CALLER_MAX_CHARS:
        raise APIError(400, f"the {CALLER_HEADER} header {value[:60]!r} is invalid: send a label of 1-"
                       f"{CALLER_MAX_CHARS} printable characters, percent-encoded as UTF-8 "
                       f"(art_core.wire.encode_caller)", param=CALLER_HEADER, code="invalid_caller")
    return label
