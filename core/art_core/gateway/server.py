"""``Gateway``: the app served by uvicorn inside the caller's event loop, with an explicit lifecycle.

    async with Gateway(engine, GatewaySettings(model_name="agent")) as gateway:
        client = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused")
        ...                                    # or gateway.rollout_base_url(rollout_id) per rollout
        await gateway.pause_for_training()     # see control.py
        await gateway.resume_after_training(step)

The gateway binds its socket itself (so ``port=0`` yields the real port at once, and a port in use is a
``ConfigError`` rather than uvicorn's ``sys.exit``), and leaves signal handling to the host program.
The engine and the record store belong to the caller: ``aclose()`` closes neither.
"""

from __future__ import annotations

import asyncio
import enum
import socket
from pathlib import Path
from types import TracebackType

from ..engines.base import Engine
from ..errors import ConfigError, LifecycleError
from .app import create_app
from .control import GatewayControl
from .listen import EmbeddedServer, bind, start_server
from .metrics import GatewayMetrics
from .records import RecordStore
from .settings import GatewaySettings
from ..wire import ROLLOUT_ID_PATTERN, RolloutStatus

__all__ = ["Gateway"]


class _State(enum.Enum):
    NEW = "new"
    STARTED = "started"
    CLOSED = "closed"


class Gateway:
    """The OpenAI-compatible gateway in front of an engine, as an async context manager.

    Args:
        engine: the engine to serve.
        settings: host, port, API key, model names, limits. Default: ``GatewaySettings()``.
        records: where exchanges are recorded. Default: a ``RecordStore`` from ``settings``.

    Attributes:
        control: the training handshake (``pause_for_training`` / ``resume_after_training``).
        records: the record store.
        metrics: the counters served at ``/metrics``.
        app: the FastAPI app.
    """

    def __init__(
        self, engine: Engine, settings: GatewaySettings | None = None, records: RecordStore | None = None
    ) -> None:
        self.engine = engine
        self.settings = settings if settings is not None else GatewaySettings()
        self.records = records if records is not None else RecordStore(
            self.settings.records_path, max_in_memory=self.settings.max_records_in_memory,
            fsync=self.settings.fsync_records)
        self.control = GatewayControl(engine)
        self.metrics = GatewayMetrics()
        self.app = create_app(engine, self.settings, self.records, control=self.control, metrics=self.metrics)
        self._state = _State.NEW
        self._server: EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None
        self._socket: socket.socket | None = None
        self._port: int | None = None
        self._mounted_url: str | None = None

    # --- lifecycle ---

    async def start(self) -> Gateway:
        """Bind the socket and start serving in the current event loop; returns once it accepts connections.

        Raises:
            LifecycleError: already started, or closed.
            ConfigError: the host/port cannot be bound (the message says which and why).
        """
        if self._state is not _State.NEW:
            raise LifecycleError(f"Gateway.start() called on a {self._state.value} gateway: a gateway starts once; "
                                 "create a new Gateway to serve again")
        self._socket = bind(self.settings.host, self.settings.port, fix="pick another port, or port=0 for a free one")
        self._port = self._socket.getsockname()[1]

        def failed(error: BaseException | None) -> Exception:
            assert self._socket is not None
            self._socket.close()
            self._state = _State.CLOSED
            return LifecycleError(f"the gateway failed to start on {self.settings.host}:{self._port}: {error}")

        self._server, self._task = await start_server(
            self.app, self._socket, failed=failed,
            proxy_headers=False)  # nothing reads the client's address; saves a layer on every request
        self._state = _State.STARTED
        return self

    def attach(self, url: str) -> Gateway:
        """Serve through a host application instead of a port of its own (``art-core serve`` does this).

        Nothing is bound: the host routes the requests under ``url`` to ``gateway.app`` (and does the
        authentication), and ``base_url`` / ``rollout_base_url`` are built on ``url``.

        Args:
            url: where the host serves ``app``, e.g. ``http://10.0.0.5:7999/gateway/default/agent``.

        Raises:
            LifecycleError: already started, attached, or closed.
        """
        if self._state is not _State.NEW:
            raise LifecycleError(f"Gateway.attach() called on a {self._state.value} gateway: a gateway starts once")
        self._mounted_url = url.rstrip("/")
        self._state = _State.STARTED
        return self

    async def aclose(self) -> None:
        """Stop accepting requests, answer held ones 503, finish in-flight ones, and stop the server.

        Closing twice is allowed; the engine and records stay open (they belong to the caller).
        """
        if self._state is _State.CLOSED:
            return
        was_started = self._state is _State.STARTED
        self._state = _State.CLOSED
        self.control.close()
        if was_started and self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        if self._socket is not None:
            self._socket.close()

    async def __aenter__(self) -> Gateway:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # --- addresses ---

    @property
    def port(self) -> int:
        """The bound port (the real one when ``settings.port`` was 0)."""
        self._check_started("port")
        if self._port is None:
            raise LifecycleError("this gateway is attached to a host application: it has no port of its own")
        return self._port

    @property
    def url(self) -> str:
        """``http://host:port``, with a loopback address when bound to every interface (or the attached URL)."""
        if self._mounted_url is not None:
            return self._mounted_url
        host = self.settings.host
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, e.g. ``http://127.0.0.1:8123/v1``; its calls belong to no rollout."""
        return f"{self.url}/v1"

    def rollout_base_url(self, rollout_id: str) -> str:
        """The OpenAI base URL whose calls are recorded under ``rollout_id``.

        Raises:
            ConfigError: the id is not 1-128 of letters, digits, ``.``, ``_``, ``-``.
        """
        if not ROLLOUT_ID_PATTERN.fullmatch(rollout_id) or rollout_id in (".", ".."):
            raise ConfigError(f"rollout id {rollout_id!r} is invalid: use 1-128 letters, digits, '.', '_' or '-'")
        return f"{self.url}/rollouts/{rollout_id}/v1"

    def rollout_status(self, rollout_id: str) -> RolloutStatus:
        """The rollout's calls received and not answered yet, and the gateway's state (``GET .../status``)."""
        return self.control.rollout_status(rollout_id)

    # --- training handshake ---

    async def pause_for_training(self) -> None:
        """See ``GatewayControl.pause_for_training``."""
        self._check_started("pause_for_training")
        await self.control.pause_for_training()

    async def resume_after_training(self, expected_step: int, *, adapter_path: Path | None = None) -> None:
        """See ``GatewayControl.resume_after_training``."""
        self._check_started("resume_after_training")
        await self.control.resume_after_training(expected_step, adapter_path=adapter_path)

    def _check_started(self, what: str) -> None:
        if self._state is not _State.STARTED:
            raise LifecycleError(
                f"Gateway.{what} used on a {self._state.value} gateway: use it between start() and aclose()")
