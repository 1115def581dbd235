"""The FastAPI app: routes mounted at ``/v1`` and ``/rollouts/{rollout_id}/v1``, plus three ASGI layers.

Layers, outermost first (plain ASGI, so streaming responses pass through untouched):

    count requests and error statuses  ->  check the API key  ->  cap the body size  ->  routes

The hot routes (``POST .../chat/completions`` and ``POST .../responses``, the calls every rollout makes) go
through the same three layers and then straight to their endpoint, in front of Starlette's and FastAPI's
own layers, routing, dependencies and exit stack (which those endpoints do not use): about a fifth of the
gateway's own time per request (benchmark part (c)). Their errors are answered by the same handlers; every
other route goes through FastAPI as usual.

Routes:

    POST /v1/chat/completions                 chat.py
    GET  /v1/models, /v1/models/{model}       served.py
    (the same under /rollouts/{rollout_id}/v1/..., which records the calls under that rollout)
    GET  /rollouts/{rollout_id}/records       that rollout's exchange records, oldest first (JSON list)
    GET  /rollouts/{rollout_id}/status        its calls received and not answered yet (``wire.RolloutStatus``)
    GET  /metrics                             counters (JSON)
    GET  /health                              gateway state and the engine's health (as last checked)

``/health`` and ``/metrics`` never wait on the engine: they answer from state the gateway holds, the engine's
part from the report ``health.py`` refreshes every second in the background, whose age in seconds is the
``X-Art-Health-Age`` header of ``/health`` and ``engine_health_age_s`` of ``/metrics``. Monitoring polls them
hardest when the engine is saturated, and then its own health check is slow (see health.py).
"""

from __future__ import annotations

import inspect
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..engines.base import Engine
from . import chat, responses, served
from .auth import BearerAuth
from .chat_template import ChatTemplate
from .control import GatewayControl
from .errors import error_response, install_error_handlers
from .health import EngineHealth
from .metrics import GatewayMetrics
from .prompt_encoder import PromptEncoder
from .records import RecordStore
from .settings import GatewaySettings
from .state import GatewayState, check_rollout_id, get_state
from .tokens import Detokenizer

__all__ = ["create_app"]

# Recent FastAPI (0.165 here) traces and meters every request through the host program's global OpenTelemetry providers
# once any is set (Langfuse sets one): a span per completion call in the user's traces, and, even with none
# set, a provider look-up per request. The gateway's calls are recorded by the gateway itself.
_NO_NATIVE_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})


def create_app(
    engine: Engine,
    settings: GatewaySettings,
    records: RecordStore | None = None,
    *,
    control: GatewayControl | None = None,
    metrics: GatewayMetrics | None = None,
    health: EngineHealth | None = None,
) -> FastAPI:
    """Build the gateway's ASGI app (``Gateway`` serves it; tests may mount it directly).

    Args:
        engine: serves the completions.
        settings: the gateway's settings.
        records: where exchanges are recorded. Default: a new ``RecordStore`` from ``settings``.
        control: pause/resume for training. Default: a new ``GatewayControl(engine)``.
        metrics: counters. Default: new ones.
        health: the engine's health, checked in the background. Default: a new ``EngineHealth(engine)``,
            started by the first ``/health`` or ``/metrics`` request.

    Returns:
        The app; its shared state is ``app.state.gateway`` (a ``GatewayState``).
    """
    state = GatewayState(
        engine=engine,
        settings=settings,
        records=records if records is not None else RecordStore(
            settings.records_path, max_in_memory=settings.max_records_in_memory,
            fsync=settings.fsync_records),
        control=control if control is not None else GatewayControl(engine),
        metrics=metrics if metrics is not None else GatewayMetrics(),
        detokenizer=Detokenizer(engine.tokenizer),
        prompt_encoder=PromptEncoder(engine.tokenizer),
        chat_template=ChatTemplate(engine.tokenizer),
        health=health if health is not None else EngineHealth(engine),
    )
    app = _GatewayApp(title="art-core gateway", docs_url=None, redoc_url=None, openapi_url=None,
                      **_NO_NATIVE_TELEMETRY)
    app.state.gateway = state
    install_error_handlers(app)
    for prefix in ("/v1", "/rollouts/{rollout_id}/v1"):
        app.include_router(chat.router, prefix=prefix)
        app.include_router(responses.router, prefix=prefix)
        app.include_router(served.router, prefix=prefix)

    @app.get("/rollouts/{rollout_id}/records")
    async def rollout_records(rollout_id: str, state: GatewayState = Depends(get_state)) -> list[dict[str, Any]]:
        check_rollout_id(rollout_id, where="the URL path")
        return [record.model_dump(mode="json") for record in state.records.for_rollout(rollout_id)]

    @app.get("/rollouts/{rollout_id}/status")
    async def rollout_status(rollout_id: str, state: GatewayState = Depends(get_state)) -> dict[str, Any]:
        check_rollout_id(rollout_id, where="the URL path")
        return state.control.rollout_status(rollout_id).model_dump(mode="json")

    @app.get("/metrics")
    async def metrics_route(state: GatewayState = Depends(get_state)) -> dict[str, Any]:
        assert state.health is not None  # create_app always gives one
        _, age = state.health.report()
        return {**state.metrics.snapshot(), "in_flight": state.control.in_flight, "state": state.control.state,
                "adapter_step": state.engine.adapter_step, "engine_health_age_s": age}

    @app.get("/health")
    async def health_route(state: GatewayState = Depends(get_state)) -> JSONResponse:
        assert state.health is not None
        # Waits only for a gateway's very first check, when it was never started (mounted by a host app).
        report, age = await state.health.first_report()
        headers = {"X-Art-Health-Age": f"{age:.3f}"} if age is not None else None
        return JSONResponse({"state": state.control.state, "adapter_step": state.engine.adapter_step,
                             "engine": report}, headers=headers)

    # Added innermost first: Starlette wraps each new middleware around the ones before it.
    app.add_middleware(_BodyLimit, max_bytes=settings.max_request_bytes)
    if settings.api_key is not None:
        app.add_middleware(BearerAuth, token=settings.api_key, reject=_reject_api_key)
    app.add_middleware(_CountRequests, metrics=state.metrics)
    # The hot routes get the same three layers, in the same order, in front of FastAPI's own.
    hot: ASGIApp = _HotRoutes(owner=app, endpoints={"chat/completions": chat.chat_completions,
                                                     "responses": responses.create_response})
    hot = _BodyLimit(hot, max_bytes=settings.max_request_bytes)
    if settings.api_key is not None:
        hot = BearerAuth(hot, token=settings.api_key, reject=_reject_api_key)
    app.hot_routes = _CountRequests(hot, metrics=state.metrics)
    return app


class _GatewayApp(FastAPI):
    """FastAPI, with the hot routes served in front of its layers.

    ``POST /v1/<route>`` and ``POST /rollouts/{rollout_id}/v1/<route>`` (chat completions and Responses, the
    calls every rollout makes) go to ``hot_routes``: the gateway's own request counting, API-key check and
    body limit, then the endpoint. Starlette's and FastAPI's layers (server errors, telemetry, body limit,
    exception middleware, router, dependencies, exit stack) would add nothing to them but time: a fifth of
    the gateway's own per request (benchmark part (c)). Every other request goes through FastAPI as usual.
    """

    hot_routes: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.hot_routes is not None and _hot_match(scope) is not None:
            scope["app"] = self  # what Starlette sets: Request.app, and through it the gateway's state
            return await self.hot_routes(scope, receive, send)
        await super().__call__(scope, receive, send)


def _hot_match(scope: Scope) -> tuple[str, dict[str, str]] | None:
    """The hot route a request is for and its path parameters, or None (then FastAPI routes it)."""
    if scope["type"] != "http" or scope["method"] != "POST":
        return None
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):  # mounted (``art-core serve``): the path is whole, as in Starlette
        path = path[len(root):]
    if path.startswith("/v1/"):
        route = path[4:]
        return (route, {}) if route in _HOT else None
    if path.startswith("/rollouts/"):
        rollout_id, sep, route = path[10:].partition("/v1/")
        if sep and rollout_id and "/" not in rollout_id and route in _HOT:
            return route, {"rollout_id": rollout_id}
    return None


_HOT = frozenset({"chat/completions", "responses"})


class _HotRoutes:
    """The innermost layer of the hot routes: the endpoint, called with a plain ``Request``.

    The endpoints take the plain ``Request`` and return a ``Response``, so FastAPI's routing table, dependency
    solving and exit stack add nothing to them but time. An exception is answered by the handler the app
    registered for its type (as Starlette's exception layer would). One with no handler but ``Exception``'s
    is answered by that one (a 500) and raised again, for the server to log, as Starlette's server-error
    layer does.
    """

    def __init__(self, *, owner: FastAPI, endpoints: dict[str, Any]) -> None:
        self.owner, self.endpoints = owner, endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = _hot_match(scope)
        assert match is not None  # _GatewayApp sends only hot requests here
        route, scope["path_params"] = match
        request = Request(scope, receive, send)
        try:
            response = await self.endpoints[route](request)
        except Exception as exc:
            response = self._handler(exc)
            if response is None:
                unexpected = self.owner.exception_handlers.get(Exception)
                if unexpected is not None:
                    await (await unexpected(request, exc))(scope, receive, send)
                raise
            response = await response(request, exc)
        await response(scope, receive, send)

    def _handler(self, exc: Exception) -> Any:
        handlers = self.owner.exception_handlers
        for cls in type(exc).__mro__:
            if cls is Exception:
                break
            if cls in handlers:
                return handlers[cls]
        return None


class _CountRequests:
    """Counts every HTTP request and every error status, whichever layer answered it."""

    def __init__(self, app: ASGIApp, *, metrics: GatewayMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.metrics.requests += 1

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.metrics.errors_by_status[message["status"]] += 1
            await send(message)

        await self.app(scope, receive, counting_send)


async def _reject_api_key(scope: Scope, receive: Receive, send: Send, key_given: bool) -> None:
    message = ("the API key is not valid for this gateway" if key_given
               else "no API key given: send 'Authorization: Bearer <key>' with the gateway's api_key")
    response = error_response(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    await response(scope, receive, send)


class _BodyLimit:
    """Refuses bodies over ``max_bytes`` with 413, from Content-Length or by counting, before any parsing."""

    # A body past the limit is read and dropped up to this much, so the client sees the 413 rather than a
    # reset connection; beyond it the connection is simply answered and closed.
    _DRAIN_BYTES = 64 * 1024 * 1024

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                response = error_response(
                    400, f"Content-Length {declared[:40]!r} is not a number", code="invalid_request")
                return await response(scope, receive, send)
            if int(declared) > self.max_bytes:
                return await self._too_large(scope, receive, send, size=int(declared), more_body=True)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                more = bool(message.get("more_body", False))
                return await self._too_large(scope, receive, send, size=None, more_body=more, drained=size)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            # The buffered body once, then the real channel (which reports a client disconnect).
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(
        self, scope: Scope, receive: Receive, send: Send, *, size: int | None, more_body: bool, drained: int = 0
    ) -> None:
        """Answer 413; ``size`` is the declared length, or None when counting found it too long."""
        more = more_body
        while more and drained < self._DRAIN_BYTES:
            message = await receive()
            drained += len(message.get("body", b""))
            more = message["type"] == "http.request" and message.get("more_body", False)
        response = error_response(
            413, f"the request body is {f'more than {self.max_bytes}' if size is None else size} bytes, above "
            f"this gateway's limit of {self.max_bytes}: send a shorter conversation or raise "
            "GatewaySettings.max_request_bytes",
            code="request_too_large",
        )
        await response(scope, receive, send)
