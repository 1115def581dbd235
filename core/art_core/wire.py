"""What crosses the wire: the gateway's headers, and the bodies, events and errors of the training API.

Shared by every end (the gateway, ``art-core serve``, ``RemoteBackend`` and the adapters in ``art_plugins``) and
light on purpose: it imports pydantic and ``art_core``'s own plain modules (errors, config, types), never the
server's framework, so a client imports it without torch, fastapi or starlette. Bodies are JSON of these pydantic
types, never pickle.

Gateway headers (``/v1/chat/completions`` and ``/v1/responses``): a request may carry ``X-Rollout-Id``
(``ROLLOUT_ID_PATTERN``), ``X-Art-Caller`` and ``X-Art-Seed``; every completion answers with ``X-Request-Id``,
``X-Art-Adapter-Step``, ``X-Art-Prompt-Tokens`` and, when known before the body, ``X-Art-Completion-Tokens``.

Training API (prefix ``API_PREFIX``, every route behind the bearer token)::

    GET  /health                                     server version and registered models
    POST /models                                     ModelSpec -> Registered (or server-sent events, below)
    POST /models/{project}/{name}/train              TrainRequest (GRPO or SFT) -> server-sent events
    GET  /models/{project}/{name}/train/{train_id}   re-attach to a train call's events
    POST /models/{project}/{name}/sample             SampleRequest -> list[Trajectory]
    GET  /models/{project}/{name}/checkpoints        -> list[int]
    POST /models/{project}/{name}/checkpoints/delete DeleteCheckpoints -> list[int] (the steps deleted)
    GET  /models/{project}/{name}/history            -> list[dict] (history.jsonl)

Each model's OpenAI-compatible gateway is served under ``/gateway/{project}/{name}`` (``.../v1``,
``.../rollouts/{rollout_id}/v1``, ``.../rollouts/{rollout_id}/records``, ``.../rollouts/{rollout_id}/status``:
a ``RolloutStatus``).

A train call answers with server-sent events, one JSON object each: ``accepted`` (``{"train_id", "state"}``,
state ``new``, ``running`` or ``done``), ``progress`` (``{"done", "total"}``) as micro-batches finish, then
exactly one of ``result`` (a ``TrainResult``) or ``error`` (an ``ErrorBody``). A registration sent with
``Accept: text/event-stream`` answers with ``loading`` (``{"seconds"}``) at once and every few seconds while the
model loads, then exactly one of ``registered`` (a ``Registered``) or ``error``; without that header it answers
one JSON ``Registered`` once the model is loaded.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from . import errors
from .config import StepConfig, TrainConfig
from .types import TrajectoryGroup

__all__ = ["ADAPTER_STEP_HEADER", "API_PREFIX", "CALLER_HEADER", "CALLER_MAX_CHARS", "COMPLETION_TOKENS_HEADER",
           "PROMPT_TOKENS_HEADER", "REQUEST_ID_HEADER", "ROLLOUT_ID_HEADER", "ROLLOUT_ID_PATTERN", "SEED_HEADER", "TRAIN_ID_PATTERN",
           "DeleteCheckpoints", "ErrorBody", "Registered", "RolloutStatus", "SampleRequest", "TrainRequest",
           "call_headers", "decode_caller", "encode_caller", "error_from_wire", "gateway_path", "train_id_for"]

# -- the gateway's headers ------------------------------------------------------------------------------

ROLLOUT_ID_HEADER = "X-Rollout-Id"
"""Groups a call under a rollout, like the ``/rollouts/{id}/v1`` path does."""
ROLLOUT_ID_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
"""Letters, digits, ``.``, ``_`` and ``-``: safe in URLs, file names and log lines."""
CALLER_HEADER = "X-Art-Caller"
"""Names the part of an agent that made a call (a graph node, an agent); kept in the call's record. Its value is the
label percent-encoded as UTF-8 (``encode_caller``): a header carries ASCII only, and node and agent names need not be
ASCII. The gateway decodes it (``decode_caller``)."""
CALLER_MAX_CHARS = 200
"""The longest caller label kept, in characters; ``encode_caller`` shortens a longer one to fit."""
_CALLER_SAFE = " !#$&'()*+,./:;=?@[]^_`{|}~-"  # printable ASCII kept as is; '%' and the rest are encoded
SEED_HEADER = "X-Art-Seed"
"""The sampling seed for a call whose body names none (``seed`` in chat completions; the Responses API has no
such field): the adapters send one per call of a seeded rollout, so that a run can be replayed."""

# Sent with every completion (streamed too: generation is done before the first byte), so a client or an
# observer in the client's process (art_plugins.langfuse) learns what served the call without reading the body.
REQUEST_ID_HEADER = "X-Request-Id"
"""The record's ``request_id`` (the response's ``id``), as OpenAI's API sends it."""
ADAPTER_STEP_HEADER = "X-Art-Adapter-Step"
"""The checkpoint step of the adapter that sampled the completion (0: the base model)."""
PROMPT_TOKENS_HEADER = "X-Art-Prompt-Tokens"
"""Token ids in the rendered prompt."""
COMPLETION_TOKENS_HEADER = "X-Art-Completion-Tokens"
"""Sampled token ids, summed over the ``n`` choices."""


def encode_caller(label: str) -> str:
    """``label`` as an ``X-Art-Caller`` value: at most ``CALLER_MAX_CHARS`` characters (a longer one keeps its start
    and ends in "..."), control characters made spaces, then percent-encoded as UTF-8."""
    from urllib.parse import quote

    label = re.sub(r"[\x00-\x1f\x7f]", " ", label)
    if len(label) > CALLER_MAX_CHARS:
        label = label[: CALLER_MAX_CHARS - 3] + "..."
    return quote(label, safe=_CALLER_SAFE)


def decode_caller(value: str) -> str:
    """The label an ``X-Art-Caller`` value names (``encode_caller``'s inverse; a value sent without encoding comes
    back unchanged unless it holds a ``%`` followed by two hex digits)."""
    from urllib.parse import unquote

    return unquote(value, errors="replace")


def call_headers(request_id: str, adapter_step: int, prompt_tokens: int,
                 completion_tokens: int | None) -> dict[str, str]:
    """The response headers that describe one recorded call.

    ``completion_tokens`` is None for a live stream: its headers leave before the tokens are sampled (the
    count is in the stream's usage chunk and in the record).
    """
    headers = {REQUEST_ID_HEADER: request_id, ADAPTER_STEP_HEADER: str(adapter_step),
               PROMPT_TOKENS_HEADER: str(prompt_tokens)}
    if completion_tokens is not None:
        headers[COMPLETION_TOKENS_HEADER] = str(completion_tokens)
    return headers


class RolloutStatus(BaseModel):
    """What a gateway knows of a rollout's calls beyond their records (``GET .../rollouts/{rollout_id}/status``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    unanswered: int = Field(ge=0)
    """Calls received and not answered yet: held while the gateway is paused, being sampled, or being recorded.
    A rollout that ended with some has not seen their answers, and its records lack them."""
    gateway: Literal["serving", "paused", "closed"]
    """The gateway's state now: ``paused`` while a training step runs (requests wait), or after its checkpoint
    failed to load."""


# -- the training API -----------------------------------------------------------------------------------

API_PREFIX = "/art/v1"
"""The training API's version prefix; a breaking change gets ``/art/v2`` beside it."""

TRAIN_ID_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def gateway_path(project: str, name: str) -> str:
    """Where the server serves a model's gateway (its OpenAI base URL is this plus ``/v1``)."""
    return f"/gateway/{project}/{name}"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Registered(_Body):
    """The answer to a register call."""

    step: int
    """The step served (0: the base model)."""
    model_dir: str
    """``<root>/<project>/models/<name>`` on the server's disk."""


class TrainRequest(_Body):
    """One train call. ``train_id`` makes it idempotent: the same id never trains twice."""

    train_id: str = Field(pattern=TRAIN_ID_PATTERN.pattern)
    """Chosen by the client (``train_id_for`` by default: a digest of the groups and config)."""
    groups: list[TrajectoryGroup] = Field(min_length=1)
    config: StepConfig = Field(default_factory=TrainConfig)
    """``TrainConfig`` (a GRPO step) or ``SFTConfig`` (a supervised step), told apart by ``kind``; a config
    without ``kind`` is GRPO's."""


class SampleRequest(_Body):
    """``TrainableModel.sample``'s arguments."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    n: int = Field(1, ge=1, le=128)
    max_tokens: int = Field(256, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    tools: list[dict[str, Any]] | None = None
    seed: int | None = None


class DeleteCheckpoints(_Body):
    steps: list[int]


class ErrorBody(_Body):
    """An error as it crosses the wire: the ``art_core.errors`` class name and the message, unchanged."""

    type: str
    message: str
    param: str | None = None
    """The request field at fault, for a body that failed validation (``groups.0.trajectories.1.reward``)."""


def train_id_for(project: str, name: str, groups_json: bytes, config_json: bytes) -> str:
    """The default train id: a digest of what is trained, so the same groups sent twice train once."""
    digest = hashlib.sha256()
    for part in (project.encode(), name.encode(), groups_json, config_json):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()[:32]


def error_from_wire(body: ErrorBody) -> errors.ArtError:
    """The exception the server raised, as the same ``art_core.errors`` class with the same message.

    Anything else the server raised (a bug, a torch error) arrives as a ``ServerError`` naming its type.
    """
    cls = getattr(errors, body.type, None) if body.type in errors.__all__ else None
    if isinstance(cls, type) and issubclass(cls, errors.ArtError):
        return cls(body.message)
    return errors.ServerError(f"the server failed with {body.type}: {body.message}")
