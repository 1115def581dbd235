"""Send an agent's calls for the trainable model to the gateway, only inside a rollout scope.

Agents build their OpenAI clients themselves (``ChatOpenAI(model=...)``, ``AsyncOpenAI()`` inside the
Agents SDK), often before any rollout starts, and we may not change their code. Every such client sends
through ``httpx.Client.send`` / ``AsyncClient.send`` (``httpx2`` for openai>=3), so that is where a
request can be redirected without touching the client: while a ``Route`` is current (a context
variable, so concurrent rollouts and other threads never see each other's), a POST to
``.../chat/completions`` or ``.../responses`` whose JSON names one of the route's models goes to the
rollout's gateway URL instead, with the gateway's key. Everything else passes through untouched.

A seeded route (``Route.seed``) also sends each call an ``X-Art-Seed`` header, derived from the rollout's seed
and the call's position in the rollout, which the gateway samples with when the body names no seed: a
rollout whose agent makes its calls in a fixed order samples the same tokens when run again.

The wrapper is installed when the first scope opens and removed when the last one closes: outside every
scope the classes are exactly as the libraries shipped them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import importlib
import json
import logging
import re
import threading
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from art_core._served_loops import loop_serving
from art_core.errors import ConfigError
from art_core.wire import CALLER_HEADER, SEED_HEADER, encode_caller

__all__ = ["CountingTransport", "Route", "current_route", "derive_seed", "routed", "unrouted", "wrappers_installed"]

logger = logging.getLogger(__name__)

_ENDPOINTS = ("/chat/completions", "/responses")
_AZURE_DEPLOYMENT = re.compile(r"/openai/deployments/([^/]+)/(?:chat/completions|responses)$")
# Headers that belong to the original destination or are recomputed for the new body.
_DROPPED_HEADERS = frozenset({"host", "content-length", "authorization", "api-key", "x-api-key", "transfer-encoding"})


def derive_seed(seed: int, index: int) -> int:
    """The seed of the ``index``-th member (a group's rollout, a rollout's call) of what ``seed`` seeds.

    A hash, not ``seed + index``: the members of neighbouring seeds never share a seed. Below 2**63, which
    every engine takes.
    """
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
"""Hosts whose servers may be this process's own (``check_blocking_call``)."""


@dataclass(eq=False)
class Route:
    """Where one rollout's calls for the trainable model go, and what the scope saw.

    Args:
        model_names: model strings that mean the trainable model (the agent's own names for it).
        served_name: the name the gateway serves it under (request bodies are rewritten to it).
        base_url: the rollout's gateway base URL (``.../rollouts/{id}/v1``).
        api_key: the gateway's key, or None when it needs none.
        caller: returns the label of the part of the agent making the current call (a graph node), or None.
        seed: seeds the rollout's sampling: its k-th routed call is sampled with ``derive_seed(seed, k)``
            unless the agent set a seed itself. None: unseeded.
    """

    model_names: frozenset[str]
    served_name: str
    base_url: str
    api_key: str | None = None
    caller: Callable[[], str | None] | None = None
    seed: int | None = None
    on_response: Callable[[Any], None] | None = None
    """Called with the response to each routed call, in the task that made it (the rollout scope tells its
    tracers what the gateway's headers say there); it must not raise."""
    models_seen: dict[str, int] = field(default_factory=dict)
    """Every model named in a JSON POST made in the scope (any provider), with its number of calls."""
    routed_calls: int = 0
    """Calls sent to the gateway for the trainable model (redirected, or sent by the adapter's own client)."""
    delivered_calls: int = 0
    """Of those, calls whose whole request was handed to the connection: only these can reach the gateway (a call
    cut while it waited for a connection never does, and no record of it will come)."""
    refused_calls: int = 0
    """Of the delivered, calls the gateway answered with an error status (it records none of them)."""
    failed_calls: int = 0
    """Of the delivered, calls that failed before any answer (connection errors): the gateway may not record them."""
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    """The counts change from every thread the rollout's calls are made in (a graph's synchronous nodes run in
    parallel threads): ``+=`` on an attribute is not atomic, and two calls must never take the same position."""
    _positions: int = field(default=0, init=False, repr=False)
    """Calls given a position (and, when seeded, its seed) by ``call_headers``."""
    _waiting: set[Any] = field(default_factory=set, init=False, repr=False)
    """The calls (their deliveries) whose client still waits for the answer."""
    _warned_loop: bool = field(default=False, init=False, repr=False)
    """Whether ``check_blocking_call`` has warned already."""

    @property
    def waiting_calls(self) -> int:
        """Routed calls whose client still waits for the gateway's answer (after the rollout ended, only calls made
        from threads: a synchronous node's thread goes on when the rollout's task is cancelled)."""
        return len(self._waiting)

    @property
    def calls_to_record(self) -> int:
        """Calls the gateway should have recorded by now: delivered, neither refused nor failed, and no longer
        awaited by their client (finished, or cut off: the gateway records a cut call once it sees the client go)."""
        with self._lock:
            awaited = sum(d.delivered for d in self._waiting)
        return self.delivered_calls - self.refused_calls - self.failed_calls - awaited

    @property
    def calls_maybe_recorded(self) -> int:
        """Calls the gateway may have recorded by now: ``calls_to_record`` plus those that may have reached it
        unseen (a transport that sends ``request.content`` without reading the body stream never marks delivery)."""
        return self.routed_calls - self.refused_calls - self.failed_calls - self.waiting_calls

    @contextlib.contextmanager
    def calling(self, request: Any) -> Iterator[Any]:
        """Count ``request`` (an httpx request about to be sent) while the code inside sends it: routed, delivered
        once its body is out, failed if it raises before any answer, and waited for until it ends. Yields the
        handle for ``call_answered``."""
        with self._lock:
            self.routed_calls += 1
        request.stream = delivery = _delivery(request.stream, self, request)
        with self._lock:
            self._waiting.add(delivery)
        try:
            yield delivery
        except Exception:
            if delivery.delivered:  # a cancelled call is no failure: the gateway records it as cut
                with self._lock:
                    self.failed_calls += 1
            raise
        finally:
            with self._lock:
                self._waiting.discard(delivery)

    def call_answered(self, delivery: Any, response: Any) -> None:
        """Note the status the gateway answered a routed call with, and hand the response to ``on_response``."""
        delivery.mark()  # an answer means it arrived, whether or not the transport read the stream
        self.count_answer(response.status_code)
        if self.on_response is not None:
            self.on_response(response)

    def check_blocking_call(self) -> None:
        """Refuse a synchronous call made on the thread of the event loop that serves the gateway; warn (once per
        rollout) about one made on the thread of another running loop.

        The call blocks that loop until answered. A gateway served from the same loop (``LocalBackend`` serves it in
        the caller's) could never answer: the call would hang until its client timed out (10 minutes per attempt
        with ChatOpenAI's defaults), so it is refused before it is sent.

        Raises:
            ConfigError: the gateway is served by the loop running on this thread.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # an ordinary thread (a graph's sync node, a worker): the loop stays free
        fix = ("Run the graph with ainvoke/astream (or trainable(...).rollout(method='invoke'), which uses a thread of "
               "its own), or call invoke from a thread: await asyncio.to_thread(graph.invoke, ...)")
        address = urlsplit(self.base_url)
        if address.hostname in _LOOPBACK and loop_serving(address.port) is loop:
            raise ConfigError("a synchronous call to the trainable model was made on the thread of the event loop "
                              "that serves its gateway: blocked until answered, that loop could never answer it. "
                              + fix)
        if not self._warned_loop:
            self._warned_loop = True
            logger.warning(
                "a synchronous call to the trainable model is made from the thread of a running event loop: it "
                "blocks the loop until answered, and a gateway served from that loop could never answer it. " + fix)

    def caller_label(self) -> str | None:
        """The ``X-Art-Caller`` value for the call being made now (the part of the agent making it), if any."""
        label = self.caller() if self.caller is not None else None
        return encode_caller(label) if label else None

    def call_headers(self) -> list[tuple[str, str]]:
        """The headers the gateway reads for the call being made now: its caller label and, when seeded, its seed.

        Call it once per call, before ``calling``: each call takes the next position (the index of its seed), under
        a lock, since a rollout's calls may come from several threads at once.
        """
        headers = []
        label = self.caller_label()
        if label:
            headers.append((CALLER_HEADER, label))
        with self._lock:
            position, self._positions = self._positions, self._positions + 1
        if self.seed is not None:
            headers.append((SEED_HEADER, str(derive_seed(self.seed, position))))
        return headers

    def count_answer(self, status_code: int) -> None:
        """Note the status the gateway answered a routed call with."""
        if status_code >= 400:
            with self._lock:
                self.refused_calls += 1

    def count_delivered(self) -> None:
        """Note that a routed call's whole request was handed to the connection."""
        with self._lock:
            self.delivered_calls += 1

    def rewrite(self, request: Any) -> Any:
        """The request to send instead of ``request`` (the same object when it is not for the trainable model)."""
        if request.method != "POST" or "json" not in request.headers.get("content-type", ""):
            return request
        try:
            body = json.loads(request.content)
        except Exception:  # a streamed or non-JSON body: no model call we can see or route
            return request
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) and isinstance(body, dict):
            # Azure OpenAI names the model by its deployment, in the URL only (AzureChatOpenAI(azure_deployment=...))
            deployment = _AZURE_DEPLOYMENT.search(request.url.path)
            model = urllib.parse.unquote(deployment.group(1)) if deployment else None
        if not isinstance(model, str):
            return request
        # Any provider's model call counts here (Anthropic's /v1/messages too), for the "never called" error.
        with self._lock:
            self.models_seen[model] = self.models_seen.get(model, 0) + 1
        path = request.url.path
        endpoint = next((e for e in _ENDPOINTS if path.endswith(e)), None)
        if endpoint is None or model not in self.model_names:
            return request
        content = request.content
        if body.get("model") != self.served_name:
            body["model"] = self.served_name
            content = json.dumps(body).encode()
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in _DROPPED_HEADERS]
        if self.api_key is not None:
            headers.append(("authorization", f"Bearer {self.api_key}"))
        headers += self.call_headers()
        return type(request)(request.method, self.base_url + endpoint, headers=headers, content=content,
                             extensions=request.extensions)


def _delivery(stream: Any, route: Route, request: Any) -> Any:
    """``stream`` (a request's body) wrapped so that its call counts on ``route`` as delivered once the transport
    has read all of it. The wrapper derives from the request's library's own stream classes (httpx, httpx2),
    since clients check ``isinstance(request.stream, ...)`` before sending."""
    return _delivery_class(type(request).__module__.partition(".")[0])(stream, route)


@functools.cache
def _delivery_class(library: str) -> type:
    module = importlib.import_module(library)

    class Delivery(module.SyncByteStream, module.AsyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, stream: Any, route: Route) -> None:
            self._stream, self._route = stream, route
            self.delivered = False

        def __iter__(self) -> Iterator[bytes]:
            yield from self._stream
            self.mark()

        async def __aiter__(self) -> AsyncIterator[bytes]:
            async for chunk in self._stream:
                yield chunk
            self.mark()

        def mark(self) -> None:
            if not self.delivered:
                self.delivered = True
                self._route.count_delivered()

    return Delivery


_current: ContextVar[Route | None] = ContextVar("art_plugins_route", default=None)


def current_route() -> Route | None:
    """The route of the rollout scope the caller is in, if any."""
    return _current.get()


@contextlib.contextmanager
def routed(route: Route) -> Iterator[Route]:
    """Make ``route`` current for the code inside (and the tasks and threads it starts with copied context)."""
    _install()
    token = _current.set(route)
    try:
        yield route
    finally:
        _current.reset(token)
        _uninstall()


@contextlib.contextmanager
def unrouted() -> Iterator[None]:
    """No route current in the code inside: its calls go where they were sent (the teacher proxy's own calls)."""
    token = _current.set(None)
    try:
        yield
    finally:
        _current.reset(token)


@contextlib.contextmanager
def wrappers_installed() -> Iterator[None]:
    """Keep the wrappers in place without making any route current.

    For work started inside ``routed()`` that outlives it: a task created in the scope copied the route
    (e.g. the Agents SDK's streamed run), and its calls must still be redirected after the code that
    started it has left the scope.
    """
    _install()
    try:
        yield
    finally:
        _uninstall()


# --- the scoped wrappers ------------------------------------------------------------------------------
# Installed by reference count: the first open scope installs, the last one to close restores the originals.

_lock = threading.Lock()
_open_scopes = 0
_originals: list[tuple[type, Callable[..., Any], Callable[..., Any]]] = []  # (class, original send, wrapper)


def _client_classes() -> list[tuple[type, bool]]:
    found = []
    for module_name in ("httpx", "httpx2"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        found += [(module.Client, False), (module.AsyncClient, True)]
    return found


def _wrap(original: Callable[..., Any], is_async: bool) -> Callable[..., Any]:
    # A cancelled call (the rollout's timeout) is neither refused nor failed: the gateway records it as cut.
    if is_async:
        async def send_async(self: Any, request: Any, **kwargs: Any) -> Any:
            route = _current.get()
            sent = route.rewrite(request) if route is not None else request
            if sent is request:
                return await original(self, request, **kwargs)
            assert route is not None
            with route.calling(sent) as delivery:
                response = await original(self, sent, **kwargs)
            route.call_answered(delivery, response)
            return response
        return send_async

    def send(self: Any, request: Any, **kwargs: Any) -> Any:
        route = _current.get()
        sent = route.rewrite(request) if route is not None else request
        if sent is request:
            return original(self, request, **kwargs)
        assert route is not None
        route.check_blocking_call()
        with route.calling(sent) as delivery:
            response = original(self, sent, **kwargs)
        route.call_answered(delivery, response)
        return response
    return send


class CountingTransport:
    """An async httpx transport that counts its requests on a ``Route`` and labels them with the caller (and the
    seed, on a seeded route), for a client the adapter built itself (which needs no redirect): the count lets a
    rollout that was cut short wait for the records of its calls.

    Args:
        inner: the transport that sends (e.g. ``httpx2.AsyncHTTPTransport()``).
        route: where to count.
    """

    def __init__(self, inner: Any, route: Route) -> None:
        self._inner, self._route = inner, route

    async def handle_async_request(self, request: Any) -> Any:
        for name, value in self._route.call_headers():
            request.headers[name] = value
        with self._route.calling(request) as delivery:
            response = await self._inner.handle_async_request(request)
        self._route.call_answered(delivery, response)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> CountingTransport:
        await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self._inner.__aexit__(*exc_info)


def _install() -> None:
    global _open_scopes
    with _lock:
        _open_scopes += 1
        if _open_scopes > 1:
            return
        for cls, is_async in _client_classes():
            original = cls.send
            wrapper = _wrap(original, is_async)
            cls.send = wrapper  # type: ignore[method-assign]
            _originals.append((cls, original, wrapper))


def _uninstall() -> None:
    global _open_scopes
    with _lock:
        _open_scopes -= 1
        if _open_scopes > 0:
            return
        for cls, original, wrapper in _originals:
            # If someone wrapped ours meanwhile, restoring would drop their wrapper: ours then stays, inert
            # (with no route current it passes every request through unchanged).
            if cls.send is wrapper:
                cls.send = original  # type: ignore[method-assign]
        _originals.clear()


def installed() -> bool:
    """Whether the wrappers are in place (some scope is open); for tests and debugging."""
    with _lock:
        return _open_scopes > 0
