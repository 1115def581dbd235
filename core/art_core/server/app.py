"""The server's ASGI app: the training API over a backend, and every model's gateway, on one port.

The backend is any ``Backend`` that also hands out each model's running ``Gateway`` (``ServedBackend``):
``LocalBackend`` (one machine) or ``RayBackend`` (engine replicas and a trainer group on a Ray cluster).

    bearer_token (every route)  ->  TrainingBody (API bodies: limit, gzip)  ->  /art/v1/...   the training API
                                                                           ->  /gateway/...  each model's gateway

Routes and events are listed in ``wire.py``. Errors answer ``{"error": {"type", "message", "param"}}`` with
the ``art_core.errors`` class name, so ``RemoteBackend`` raises the same class with the same message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import __version__
from ..backends._shared import append_history, read_history
from ..backends.base import Backend, ModelSpec, Progress, TrainResult
from ..config import STEP_KINDS
from ..errors import (
    ArtError,
    BaseModelNotFoundError,
    CheckpointError,
    ConfigError,
    LifecycleError,
    ModelNotRegisteredError,
    TrajectoryError,
)
from .guard import TrainingBody, bearer_token, send_error
from .jobs import TrainJobs
from ..wire import (
    API_PREFIX,
    DeleteCheckpoints,
    Registered,
    SampleRequest,
    TrainRequest,
    gateway_path,
    train_id_for,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..config import SFTConfig, TrainConfig
    from ..gateway import Gateway
    from ..types import TrajectoryGroup

__all__ = ["REGISTER_HEARTBEAT_S", "ServedBackend", "ServerApp", "create_server_app"]

logger = logging.getLogger(__name__)

REGISTER_HEARTBEAT_S = 5.0
"""Seconds between a registration's ``loading`` events: well under any client's read timeout (60 s default)."""

# Most specific first: the first class an error is an instance of gives the status.
_STATUS: list[tuple[type[ArtError], int]] = [
    (BaseModelNotFoundError, 404), (ConfigError, 400), (TrajectoryError, 422), (LifecycleError, 409),
    (CheckpointError, 409), (ArtError, 500),
]


class _ServedModels:
    """The specs registered on this server, keyed like the backend keys them."""

    def __init__(self) -> None:
        self.specs: dict[tuple[str, str], ModelSpec] = {}


class ServedBackend(Backend, Protocol):
    """A ``Backend`` the server can put behind its port: it also gives each registered model's gateway, and the
    step it serves (for a client that registers a model the server has already)."""

    def gateway(self, model: ModelSpec) -> Gateway:
        """The model's running gateway (the server mounts its ``app`` at ``/gateway/<project>/<name>``)."""
        ...

    def current_step(self, model: ModelSpec) -> int:
        """The latest checkpoint written for the model (the one served, unless publishing it failed)."""
        ...

    async def train(self, model: ModelSpec, groups: Sequence[TrajectoryGroup], config: TrainConfig | SFTConfig, *,
                    progress: Progress | None = None, train_id: str | None = None) -> TrainResult:
        """``Backend.train``, with the server's call id kept in the checkpoint (``StepRunner.run``)."""
        ...


def create_server_app(backend: ServedBackend, *, token: str | None, max_body_bytes: int,
                      heartbeat: float = REGISTER_HEARTBEAT_S) -> ServerApp:
    """Build the server's app over ``backend`` (see ``run.serve``).

    Args:
        backend: trains and serves the models.
        token: the bearer token every route wants; None only on a loopback host.
        max_body_bytes: largest training-API body, before and after gzip.
        heartbeat: seconds between the ``loading`` events of a registration that asked for events.

    Returns:
        The app; ``app.jobs`` holds the train calls (``aclose`` them on shutdown).
    """
    served = _ServedModels()
    jobs = TrainJobs()
    registering = asyncio.Lock()  # two clients registering one model at once: one loads it, one attaches
    loads: set[asyncio.Task[Registered]] = set()  # registrations under way (a task holds only a weak reference)

    def spec_of(request: Request) -> ModelSpec:
        key = (request.path_params["project"], request.path_params["name"])
        spec = served.specs.get(key)
        if spec is None:
            raise ModelNotRegisteredError(f"model {key[1]!r} of project {key[0]!r} is not registered on this server: "
                                 "call `await model.register(RemoteBackend(...))` first")
        return spec

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "version": __version__, "api": API_PREFIX,
                             "models": [spec.model_dump() for spec in served.specs.values()]})

    async def register(request: Request) -> Response:
        spec = _parse(ModelSpec, await request.body())
        # The load runs in a task of its own: a client that leaves mid-load does not cut it in half, and its
        # next registration of the same spec attaches to the loaded model.
        load = asyncio.ensure_future(load_model(spec))
        loads.add(load)
        load.add_done_callback(finished)
        if "text/event-stream" in request.headers.get("accept", ""):
            return _loading_events(load, heartbeat)
        return _json(await asyncio.shield(load))  # a client that asked for one JSON answer

    def finished(load: asyncio.Task[Registered]) -> None:
        loads.discard(load)
        if not load.cancelled():
            load.exception()  # retrieved here: a failure whose client had left is not an "unretrieved" error

    async def load_model(spec: ModelSpec) -> Registered:
        key = (spec.project, spec.name)
        async with registering:
            known = served.specs.get(key)
            if known is None:
                step = await backend.register(spec)
                served.specs[key] = spec
            elif known != spec:
                raise LifecycleError(f"model {spec.name!r} of project {spec.project!r} is already registered on "
                                     f"this server with another spec ({_spec_diff(known, spec)}): use another name")
            else:  # the same model again (its client restarted): attach to what is served
                step = backend.current_step(spec)
        return Registered(step=step, model_dir=str(backend.model_dir(spec)))

    async def train(request: Request) -> Response:
        spec = spec_of(request)
        body = _parse(TrainRequest, await request.body())
        groups_json = b"\n".join(g.model_dump_json().encode() for g in body.groups)
        digest = train_id_for(spec.project, spec.name, groups_json, body.config.model_dump_json().encode())
        record_dir = backend.model_dir(spec) / "train_calls"
        job, state = jobs.attach(body.train_id, digest, record_dir)
        if job is None:
            recovered = _result_in_checkpoint(backend.model_dir(spec), body.train_id, body.config.kind)

            async def run(progress: Any) -> dict[str, Any]:
                if recovered is not None:
                    return recovered
                result = await backend.train(spec, body.groups, body.config, progress=progress, train_id=body.train_id)
                return result.model_dump(mode="json")

            job = jobs.start(body.train_id, digest, record_dir, run)
        return _events(body.train_id, state, job.follow())

    async def reattach(request: Request) -> Response:
        spec = spec_of(request)
        train_id = request.path_params["train_id"]
        job, state = jobs.attach(train_id, None, backend.model_dir(spec) / "train_calls")
        if job is None:
            return _error(404, "ConfigError", f"no train call {train_id!r} on this server: send the call again")
        return _events(train_id, state, job.follow())

    async def sample(request: Request) -> Response:
        spec = spec_of(request)
        body = _parse(SampleRequest, await request.body())
        trajectories = await backend.sample(spec, body.messages, n=body.n, max_tokens=body.max_tokens,
                                            temperature=body.temperature, tools=body.tools, seed=body.seed)
        return Response(b"[" + b",".join(t.model_dump_json().encode() for t in trajectories) + b"]",
                        media_type="application/json")

    async def checkpoints(request: Request) -> Response:
        return JSONResponse(await backend.checkpoints(spec_of(request)))

    async def delete_checkpoints(request: Request) -> Response:
        spec = spec_of(request)
        body = _parse(DeleteCheckpoints, await request.body())
        return JSONResponse(await backend.delete_checkpoints(spec, body.steps))

    async def history(request: Request) -> Response:
        return Response(json.dumps(await backend.history(spec_of(request)), default=float),
                        media_type="application/json")

    model = API_PREFIX + "/models/{project}/{name}"
    routes = [
        Route(API_PREFIX + "/health", health, methods=["GET"]),
        Route(API_PREFIX + "/models", register, methods=["POST"]),
        Route(model + "/train", train, methods=["POST"]),
        Route(model + "/train/{train_id}", reattach, methods=["GET"]),
        Route(model + "/sample", sample, methods=["POST"]),
        Route(model + "/checkpoints", checkpoints, methods=["GET"]),
        Route(model + "/checkpoints/delete", delete_checkpoints, methods=["POST"]),
        Route(model + "/history", history, methods=["GET"]),
    ]
    api = Starlette(routes=routes, exception_handlers={ArtError: _art_error, Exception: _server_error})
    inner: ASGIApp = TrainingBody(_Dispatch(api, backend, served), max_bytes=max_body_bytes)
    return ServerApp(bearer_token(inner, token=token) if token is not None else inner, jobs)


class ServerApp:
    """The composed ASGI app, and the train calls it runs."""

    def __init__(self, app: ASGIApp, jobs: TrainJobs) -> None:
        self.app, self.jobs = app, jobs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


class _Dispatch:
    """``/gateway/{project}/{name}/...`` to that model's gateway app; everything else to the training API."""

    def __init__(self, api: Starlette, backend: ServedBackend, served: _ServedModels) -> None:
        self.api, self.backend, self.served = api, backend, served

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/gateway/"):
            return await self.api(scope, receive, send)
        parts = path.split("/", 4)  # "", "gateway", project, name, rest
        spec = self.served.specs.get((parts[2], parts[3])) if len(parts) >= 4 else None
        if spec is None:
            # ModelNotRegisteredError: a RemoteBackend that had registered it (before a restart) registers again
            return await send_error(send, 404, "ModelNotRegisteredError", f"no model is served at {path[:200]!r}: "
                                    "register it first; gateways live at /gateway/<project>/<name>/v1")
        # As Starlette's Mount does: the path stays whole, root_path grows by the prefix the gateway sits under.
        prefix = gateway_path(spec.project, spec.name)
        child = dict(scope, root_path=scope.get("root_path", "") + prefix)
        await self.backend.gateway(spec).app(child, receive, send)


def _result_in_checkpoint(model_dir: Path, train_id: str, kind: str) -> dict[str, Any] | None:
    """The result of a train call whose checkpoint was written but whose result was never recorded (the server was
    killed in between), from the checkpoint that names it, with its missing history row restored; None when no
    checkpoint names the call (it trains)."""
    from ..training.checkpoints import checkpoint_of_train_call

    written = checkpoint_of_train_call(model_dir, train_id)
    if written is None:
        return None
    step, metrics = written
    if not any(row.get("step") == step for row in read_history(model_dir)):
        append_history(model_dir, {"step": step, "time": time.time(), "kind": kind, **metrics})
    return TrainResult(step=step, metrics=metrics).model_dump(mode="json")


def _parse(model: type[BaseModel], body: bytes) -> Any:
    """``body`` as ``model``, or a ConfigError naming the first field at fault (the HTTP answer names it too)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(part) for part in first["loc"]]
        kind = ""
        if loc[:1] == ["config"] and loc[1:2] and loc[1] in STEP_KINDS:  # the union's tag: not a field of the body
            kind = f" (a {loc.pop(1)} step's config)"
        field = ".".join(loc) or "(the body)"
        raise _BadBody(f"invalid {model.__name__} body ({exc.error_count()} problem(s)); first: {field}{kind}: "
                       f"{first['msg']}", field) from exc


class _BadBody(ConfigError):
    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def _spec_diff(a: ModelSpec, b: ModelSpec) -> str:
    da, db = a.model_dump(), b.model_dump()
    return ", ".join(f"{k}: {da[k]!r} there, {db[k]!r} here" for k in da if da[k] != db[k])


def _events(train_id: str, state: str, events: AsyncIterator[tuple[str, dict[str, Any]]]) -> StreamingResponse:
    async def stream() -> AsyncIterator[bytes]:
        yield _sse("accepted", {"train_id": train_id, "state": state})
        async for kind, data in events:
            yield _sse(kind, data)

    return _event_stream(stream())


def _event_stream(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    # no-cache and no proxy buffering: progress must reach the client as it happens.
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _loading_events(load: asyncio.Future[Registered], heartbeat: float) -> StreamingResponse:
    """A registration as server-sent events: ``loading`` at once and every ``heartbeat`` seconds while the
    model loads, then ``registered`` (a ``Registered``) or ``error`` (an ``ErrorBody``).

    A load takes as long as the model and the machine make it (minutes for a large model, or Ray actors
    starting on a busy cluster); the heartbeats keep the client's read timeout for a server that stopped
    answering, not for a load that takes long."""
    async def stream() -> AsyncIterator[bytes]:
        started = time.monotonic()
        while True:
            yield _sse("loading", {"seconds": round(time.monotonic() - started, 1)})
            done, _ = await asyncio.wait({load}, timeout=heartbeat)
            if done:
                break
        try:
            registered = load.result()
        except Exception as exc:  # the client raises the same class with the same message
            if not isinstance(exc, ArtError):
                logger.exception("registering a model failed")
            yield _sse("error", _error_fields(exc))
        else:
            yield _sse("registered", registered.model_dump(mode="json"))

    return _event_stream(stream())


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, default=float)}\n\n".encode()


def _json(body: BaseModel) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


def _error(status: int, type_: str, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"type": type_, "message": message, "param": param}}, status_code=status)


def _error_fields(exc: Exception) -> dict[str, Any]:
    """An ``ErrorBody``'s fields for ``exc``: the client raises the same class with the same message."""
    kind = "ConfigError" if isinstance(exc, _BadBody) else type(exc).__name__
    return {"type": kind, "message": str(exc), "param": getattr(exc, "field", None)}


async def _art_error(request: Request, exc: Exception) -> Response:
    status = next(code for cls, code in _STATUS if isinstance(exc, cls))
    fields = _error_fields(exc)
    return _error(status, fields["type"], fields["message"], fields["param"])


async def _server_error(request: Request, exc: Exception) -> Response:
    logger.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
    return _error(500, type(exc).__name__, str(exc))
