"""Every use of the Langfuse SDK's non-public parts, in one place. Checked against langfuse 5.0.4.

The SDK has no public accessor for these. Each is reached here and nowhere else, read defensively where a
fallback exists; ``tests/plugins/test_langfuse_sdk.py`` checks each of them against the installed SDK and fails
loudly, naming the part, when one moves. When the SDK gains a public way, use it here.

- The client's public key and tracer provider (``Langfuse._resources``): the LangChain handler finds its client
  by public key, and OpenInference (the Agents SDK's instrumentation) needs the provider to export through.
- Whether the client masks data, and its mask (``Langfuse._mask``): a masking function expects the data, not
  JSON text; trace-level labels (the task text) bypass the SDK's masking, so they go through it here.
- Inside Langfuse's LangChain ``CallbackHandler``, which ``_langfuse_langchain.LightStateHandler`` subclasses:
  its client (``_langfuse_client``), its open observations by run id (``_runs``), its run bookkeeping
  (``_track_run``), its message conversion (``_convert_message_to_dict``) and the shared body of
  ``on_llm_start``/``on_chat_model_start`` (``__on_llm_action``, name-mangled), which takes the prompt as given.
- An observation's OpenTelemetry span (``_otel_span``), to set an attribute without the SDK's re-encoding.

The JSON the SDK writes for plain data is produced by ``plain_json`` and ``metadata_json`` (``json.dumps`` of
plain values gives the same text as the SDK's ``EventSerializer`` and ``_serialize_metadata_value``); the test
compares them with the SDK's own on the same values.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from uuid import UUID

if TYPE_CHECKING:  # imported by the caller: the client's parts need no LangChain installed
    from langfuse.langchain import CallbackHandler

__all__ = ["CHECKED_VERSION", "client_masks", "client_public_key", "client_tracer_provider", "convert_message",
           "handler_client", "is_plain", "llm_action", "masked", "metadata_json", "observation_span",
           "open_observation", "plain_json", "track_run"]

CHECKED_VERSION = "5.0.4"
"""The langfuse release these were read from."""

_MAX_SAFE_INT = 2**53 - 1  # the SDK's serializer writes integers beyond JavaScript's safe range as strings


def client_public_key(client: Any) -> str | None:
    return getattr(getattr(client, "_resources", None), "public_key", None)


def client_tracer_provider(client: Any) -> Any:
    """The client's OpenTelemetry tracer provider (None: it uses the global one)."""
    return getattr(getattr(client, "_resources", None), "tracer_provider", None)


def client_masks(client: Any) -> bool:
    """Whether the client has a ``mask`` function; a client where this cannot be read counts as masking."""
    return getattr(client, "_mask", "unknown") is not None


def masked(client: Any, value: Any) -> Any:
    """``value`` through the client's ``mask`` (``Langfuse._mask(data=...)``), as the SDK masks an observation's
    input; unchanged without a mask, and the SDK's fallback text when the mask raises or cannot be read."""
    mask = getattr(client, "_mask", "unknown")
    if mask is None:
        return value
    try:
        return mask(data=value)
    except Exception:  # the SDK logs and sends its fallback text; here nothing is logged twice
        return "<fully masked due to failed mask function>"


def llm_action(handler_type: type[CallbackHandler]) -> Callable[..., None] | None:
    """``CallbackHandler.__on_llm_action(self, serialized, run_id, prompts, parent_run_id, *, tags, metadata,
    **kwargs)``, the body ``on_llm_start`` and ``on_chat_model_start`` share, which takes the prompt as given; None
    in an SDK without it (chat prompts then take the SDK's own ``on_chat_model_start``)."""
    return getattr(handler_type, f"_{handler_type.__name__}__on_llm_action", None)


def handler_client(handler: CallbackHandler) -> Any:
    """The ``Langfuse`` client a LangChain handler sends through (looked up by its public key)."""
    return handler._langfuse_client


def open_observation(handler: CallbackHandler, run_id: UUID) -> Any:
    """The handler's open observation of LangChain run ``run_id``, or None."""
    return handler._runs.get(run_id)


def track_run(handler: CallbackHandler, *, run_id: UUID, parent_run_id: UUID | None,
              metadata: dict[str, Any] | None) -> None:
    """The handler's bookkeeping of a run's place in its tree, done first by each of its ``on_*_start``."""
    handler._track_run(run_id=run_id, parent_run_id=parent_run_id, metadata=metadata)


def convert_message(handler: CallbackHandler, message: Any) -> dict[str, Any]:
    """A LangChain message as the handler writes it into a generation's input."""
    return handler._convert_message_to_dict(message)


def observation_span(observation: Any) -> Any:
    """The OpenTelemetry span under a Langfuse observation, or None."""
    return getattr(observation, "_otel_span", None)


def is_plain(value: Any, depth: int = 0) -> bool:
    """Plain JSON data the SDK writes exactly as ``json.dumps`` does: no data URI (media the SDK would upload),
    no integer beyond 2**53 or non-finite float (the SDK writes those as strings), not nested too deep for it."""
    kind = type(value)
    if kind is str:
        return not value.startswith("data:")
    if value is None or kind is bool:
        return True
    if kind is int:
        return -_MAX_SAFE_INT <= value <= _MAX_SAFE_INT
    if kind is float:
        return math.isfinite(value)
    if depth > 16:  # the SDK's serializer cuts deeper structures short; leave those to it
        return False
    if kind is list or kind is tuple:
        return all(is_plain(item, depth + 1) for item in value)
    if kind is dict:
        return all(type(k) is str and is_plain(v, depth + 1) for k, v in value.items())
    return False


def plain_json(value: Any) -> str | None:
    """The JSON the SDK writes for an observation's input or output, when ``value`` is plain; else None."""
    return json.dumps(value) if is_plain(value) else None


def metadata_json(value: Any) -> str:
    """The JSON the SDK writes for one metadata value (compact, non-ASCII kept); ``value`` must be plain."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
