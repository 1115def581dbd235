"""``RemoteBackend``: the Backend contract over HTTP, as a client of ``art-core serve`` on another machine.

    async with RemoteBackend("http://gpu-box:7999", token=os.environ["ART_SERVER_TOKEN"]) as backend:
        await model.register(backend)      # the server loads the model and serves its gateway
        ...                                # agents call model.rollout_base_url(...) on the server's gateway
        await model.train(groups)          # progress shown here as locally; the step runs on the server
        await model.train_sft("demos.jsonl")  # SFT too: the file is read here, its chats go over the wire

It needs no torch: only httpx and pydantic. Bodies are JSON (gzip above ``compress_above`` bytes off
loopback); see ``art_core.wire`` for the routes.

A train call is idempotent: its id is a digest of the groups and settings (or the ``train_id`` given), so a
call sent twice, or again after this process died, trains once and both get the same result. When the
connection drops during a step, the client re-attaches to it for up to ``reconnect_for`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gzip
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx
from pydantic import TypeAdapter

from ..config import SFTConfig, TrainConfig
from ..errors import ConfigError, ModelNotRegisteredError, ServerError, ServerUnavailableError
from ..wire import (
    API_PREFIX,
    ROLLOUT_ID_PATTERN,
    ErrorBody,
    Registered,
    RolloutStatus,
    SampleRequest,
    error_from_wire,
    gateway_path,
    train_id_for,
)
from ..types import Trajectory, TrajectoryGroup
from ._http import LoopClient
from ._tables import ModelTable
from ._progress import progress_bar
from ._steps import warn_dropped_groups
from .base import ModelSpec, Progress, TrainResult

if TYPE_CHECKING:
    from ..gateway.records import ExchangeRecord

__all__ = ["RemoteBackend"]

logger = logging.getLogger(__name__)

_TRAJECTORIES = TypeAdapter(list[Trajectory])


@functools.cache
def _records_adapter() -> TypeAdapter[list[ExchangeRecord]]:
    """Built on first use: the records module loads lazily."""
    from ..gateway.records import ExchangeRecord

    return TypeAdapter(list[ExchangeRecord])


class RemoteBackend:
    """Trains and serves on an ``art-core serve`` server; implements ``art_core.backends.Backend``.

    Args:
        url: the server, ``http://host:port`` (as ``art-core serve`` prints it).
        token: the server's bearer token; default ``ART_SERVER_TOKEN`` (None: the server wants none).
        timeout: seconds to wait for an answer to a call other than training.
        reconnect_for: seconds a train call keeps re-attaching after the connection drops (server restart).
        show_progress: show the training progress bar (the same display as ``LocalBackend``).
        compress_above: gzip train bodies larger than this many bytes, unless the server is on loopback.

    Raises:
        ConfigError: ``url`` is not an http(s) URL, or is an OpenAI-style base URL (ending with ``/v1``).
    """

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 60.0, reconnect_for: float = 120.0,
                 show_progress: bool = True, compress_above: int = 256 * 1024) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"RemoteBackend url {url!r} is not an http(s) URL: give the address `art-core serve` "
                              "printed, e.g. http://gpu-box:7999")
        if parts.path.rstrip("/").endswith("/v1"):  # an OpenAI-style base URL, copied from an agent's config
            raise ConfigError(f"RemoteBackend url {url!r} ends with /v1: give the server's own address as `art-core "
                              f"serve` printed it ({parts.scheme}://{parts.netloc}); the backend finds each model's "
                              "OpenAI-compatible /v1 URL on the server itself")
        self.url = url.rstrip("/")
        self.token = token if token is not None else os.environ.get("ART_SERVER_TOKEN") or None
        self.timeout = timeout
        self.reconnect_for = reconnect_for
        self.show_progress = show_progress
        loopback = parts.hostname in ("localhost", "127.0.0.1", "::1")
        self.compress_above = None if loopback else compress_above
        self._headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        # Folders are the server's (``Registered.model_dir``): the table's own root is not used.
        self._models: ModelTable[Registered] = ModelTable(Path("."), "RemoteBackend")
        self._http = LoopClient(headers=self._headers, timeout=self.timeout)

    def __repr__(self) -> str:
        return f"RemoteBackend({self.url!r})"

    async def __aenter__(self) -> RemoteBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections; the models stay served on the server. The backend cannot be used afterwards."""
        self._models.close()
        await self._http.aclose()

    # -- the Backend contract (called by TrainableModel) ----------------------------------------------

    async def register(self, model: ModelSpec) -> int:
        self._models.check_new(model)
        registered = await self._register(model)
        self._models.add(model, registered)
        return registered.step

    async def _register(self, model: ModelSpec) -> Registered:
        """POST the spec and follow the server's events until the model is loaded there.

        The server sends a ``loading`` event every few seconds while it loads, so ``timeout`` bounds the silence
        of a server that stopped answering, never the load itself (minutes for a large model).
        """
        events = self._events("POST", API_PREFIX + "/models", content=model.model_dump_json().encode(),
                              read=self.timeout)
        try:
            async with contextlib.aclosing(events):
                async for kind, data in events:
                    if kind == "loading":
                        logger.debug("registering %s/%s: the server has loaded it for %s s", model.project,
                                     model.name, data["seconds"])
                    elif kind == "registered":
                        return Registered.model_validate(data)
                    elif kind == "error":
                        raise error_from_wire(ErrorBody.model_validate(data))
        except httpx.TransportError as exc:
            raise self._unavailable(exc, during=f"the registration of {model.name!r}") from exc
        raise ServerError(f"the server at {self.url} ended the registration of {model.name!r} before the model "
                          "was loaded: see the server's log")

    def base_url(self, model: ModelSpec) -> str:
        return self._gateway_url(model) + "/v1"

    def api_key(self, model: ModelSpec) -> str | None:
        self._registered(model)
        return self.token

    def rollout_base_url(self, model: ModelSpec, rollout_id: str) -> str:
        if not ROLLOUT_ID_PATTERN.fullmatch(rollout_id) or rollout_id in (".", ".."):
            raise ConfigError(f"rollout id {rollout_id!r} is invalid: use 1-128 letters, digits, '.', '_' or '-'")
        return f"{self._gateway_url(model)}/rollouts/{rollout_id}/v1"

    async def rollout_records(self, model: ModelSpec, rollout_id: str) -> list[ExchangeRecord]:
        response = await self._gateway_get(model, f"/rollouts/{rollout_id}/records")
        return _records_adapter().validate_json(response.content)

    async def rollout_status(self, model: ModelSpec, rollout_id: str) -> RolloutStatus:
        response = await self._gateway_get(model, f"/rollouts/{rollout_id}/status")
        return RolloutStatus.model_validate_json(response.content)

    def model_dir(self, model: ModelSpec) -> Path:
        """The model's folder on the server's disk (not on this machine)."""
        return Path(self._registered(model).model_dir)

    async def train(self, model: ModelSpec, groups: Sequence[TrajectoryGroup], config: TrainConfig | SFTConfig, *,
                    progress: Progress | None = None, train_id: str | None = None) -> TrainResult:
        """The contract's ``train`` (GRPO or SFT: the config's ``kind`` goes with it), on the server. ``progress(done, total)``, when given, gets the server's
        progress events in place of the progress bar. ``train_id`` (default: a digest of the groups and config)
        makes it idempotent: the same id trains once, however often it is sent."""
        registered = self._registered(model)
        groups_json = [group.model_dump_json() for group in groups]
        config_json = config.model_dump_json()
        train_id = train_id or train_id_for(model.project, model.name, "\n".join(groups_json).encode(),
                                            config_json.encode())
        body = f'{{"train_id":{json.dumps(train_id)},"groups":[{",".join(groups_json)}],"config":{config_json}}}'
        base = f"{API_PREFIX}/models/{model.project}/{model.name}/train"
        deadline: float | None = None
        attach = False  # first POST the call; after a drop, re-attach by id (or POST again if the server lost it)
        reregistered = False
        with progress_bar(f"training step {registered.step + 1}",
                          enabled=self.show_progress and progress is None) as bar:
            report = progress or bar
            while True:
                try:
                    if attach:
                        events = self._events("GET", f"{base}/{train_id}")
                    else:
                        events = self._events("POST", base, content=body.encode())
                    async for kind, data in events:
                        if kind == "accepted":
                            logger.info("train call %s: %s on the server", train_id, data["state"])
                        elif kind == "progress" and report is not None:
                            report(data["done"], data["total"])
                        elif kind == "result":
                            result = TrainResult.model_validate(data)
                            self._models.add(model, registered.model_copy(update={"step": result.step}))
                            # The server warned in its own process: warn here too, at the user's train line.
                            policy_step = result.step - 1 if result.metrics.get("trained") else result.step
                            warn_dropped_groups(list(groups), config, policy_step, result.metrics)
                            return result
                        elif kind == "error":
                            raise error_from_wire(ErrorBody.model_validate(data))
                    raise httpx.RemoteProtocolError("the event stream ended before the step's result")
                except _NotFound:
                    attach = False  # the server restarted before the call finished: send it again
                except ModelNotRegisteredError:
                    if reregistered:
                        raise
                    # Registered here, unknown there: the server restarted and lost its registrations (during
                    # this call, or since the last one). Register again, then resend the call.
                    await self._reregister(model)
                    reregistered, attach = True, False
                except (httpx.TransportError, ServerUnavailableError) as exc:
                    now = time.monotonic()
                    deadline = deadline if deadline is not None else now + self.reconnect_for
                    if now >= deadline:
                        raise self._unavailable(exc, during=f"train call {train_id}") from exc
                    attach = True
                    await asyncio.sleep(0.5)

    async def sample(self, model: ModelSpec, messages: Sequence[dict[str, Any]], *, n: int, max_tokens: int,
                     temperature: float, tools: list[dict[str, Any]] | None, seed: int | None) -> list[Trajectory]:
        body = SampleRequest(messages=list(messages), n=n, max_tokens=max_tokens, temperature=temperature,
                             tools=tools, seed=seed)
        response = await self._model_call(model, "POST", "sample", content=body.model_dump_json().encode())
        return _TRAJECTORIES.validate_json(response.content)

    async def checkpoints(self, model: ModelSpec) -> list[int]:
        return list((await self._model_call(model, "GET", "checkpoints")).json())

    async def delete_checkpoints(self, model: ModelSpec, steps: Sequence[int]) -> list[int]:
        content = json.dumps({"steps": list(steps)}).encode()
        return list((await self._model_call(model, "POST", "checkpoints/delete", content=content)).json())

    async def history(self, model: ModelSpec) -> list[dict[str, Any]]:
        return list((await self._model_call(model, "GET", "history")).json())

    async def _model_call(self, model: ModelSpec, method: str, route: str, *,
                          content: bytes | None = None) -> httpx.Response:
        """``_call`` on one of the model's routes (``_again_after_a_restart``)."""
        self._registered(model)
        return await self._again_after_a_restart(
            model, lambda: self._call(method, self._model_path(model, route), content=content))

    async def _again_after_a_restart(self, model: ModelSpec,
                                     call: Callable[[], Awaitable[httpx.Response]]) -> httpx.Response:
        """``call()``; when the server no longer knows the model (it restarted since), the model is registered
        again and ``call()`` made once more."""
        try:
            return await call()
        except ModelNotRegisteredError:
            await self._reregister(model)
            return await call()

    async def _reregister(self, model: ModelSpec) -> None:
        """Register ``model`` again on a server that lost it (a restart): it resumes from its last checkpoint."""
        logger.info("the server at %s no longer knows %s/%s (it restarted): registering it again", self.url,
                    model.project, model.name)
        self._models.add(model, await self._register(model))

    # -- HTTP -------------------------------------------------------------------------------------------

    async def _gateway_get(self, model: ModelSpec, path: str) -> httpx.Response:
        """GET ``path`` of the model's gateway (``_again_after_a_restart``)."""
        return await self._again_after_a_restart(model, lambda: self._gateway_fetch(model, path))

    async def _gateway_fetch(self, model: ModelSpec, path: str) -> httpx.Response:
        """One GET of the model's gateway (a round trip on a pooled connection, off the loop's thread)."""
        url = self._gateway_url(model) + path
        try:
            async with self._http.client() as client:
                response = await client.get(url)
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from exc
        self._raise_for_error(response)
        return response

    def _encode(self, content: bytes) -> tuple[bytes, dict[str, str]]:
        headers = {"Content-Type": "application/json"}
        if self.compress_above is not None and len(content) > self.compress_above:
            return gzip.compress(content, compresslevel=1), {**headers, "Content-Encoding": "gzip"}
        return content, headers

    async def _call(self, method: str, path: str, *, content: bytes | None = None) -> httpx.Response:
        headers: dict[str, str] = {}
        if content is not None:
            content, headers = self._encode(content)
        self._check_open()
        try:
            async with self._http.client() as client:
                response = await client.request(method, self.url + API_PREFIX + path, content=content,
                                                headers=headers)
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from exc
        self._raise_for_error(response)
        return response

    async def _events(self, method: str, path: str, *, content: bytes | None = None,
                      read: float | None = None) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """The server-sent events of a call, as ``(kind, data)``.

        ``read``: the longest silence between two reads. None (a train call's) waits as long as it takes: a step
        may take minutes between two progress events on a big model.
        """
        headers = {"Accept": "text/event-stream"}
        if content is not None:
            content, more = self._encode(content)
            headers.update(more)
        timeout = httpx.Timeout(self.timeout, read=read)
        self._check_open()
        async with self._http.client() as client, client.stream(method, self.url + path, content=content,
                                                                headers=headers, timeout=timeout) as response:
            if response.status_code >= 400:
                await response.aread()
                if response.status_code == 404 and method == "GET":
                    raise _NotFound
                self._raise_for_error(response)
            kind, data = "message", ""
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    kind = line[6:].strip()
                elif line.startswith("data:"):
                    data += line[5:].strip()
                elif not line and data:
                    yield kind, json.loads(data)
                    kind, data = "message", ""

    def _raise_for_error(self, response: httpx.Response) -> None:
        if response.status_code < 400:
            return
        try:
            body = ErrorBody.model_validate(response.json()["error"])
        except Exception:  # not our JSON error (a proxy's page, a crash): say what came back
            raise ServerError(f"{response.request.method} {response.request.url} answered {response.status_code}: "
                              f"{response.text[:300]}") from None
        if response.status_code == 401:
            raise ConfigError(f"the server at {self.url} refused the token: {body.message}")
        raise error_from_wire(body)

    def _unavailable(self, exc: Exception, *, during: str | None = None) -> ServerUnavailableError:
        what = f" during {during}" if during else ""
        if isinstance(exc, (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout)):  # reached, but no answer
            return ServerUnavailableError(
                f"the training server at {self.url} did not answer{what} within timeout={self.timeout:g} s "
                f"({type(exc).__name__}): it may be busy (its first sample loads the engine; a loaded CPU is slow), "
                "so give it longer with RemoteBackend(url, timeout=...)")
        return ServerUnavailableError(
            f"the training server at {self.url} cannot be reached{what} ({type(exc).__name__}: {exc or 'no answer'}): "
            "check that `art-core serve` runs there and the URL and port are right")

    # -- helpers --------------------------------------------------------------------------------------

    def _gateway_url(self, model: ModelSpec) -> str:
        self._registered(model)
        return self.url + gateway_path(model.project, model.name)

    @staticmethod
    def _model_path(model: ModelSpec, route: str) -> str:
        return f"/models/{model.project}/{model.name}/{route}"

    def _registered(self, model: ModelSpec) -> Registered:
        return self._models.get(model)

    def _check_open(self) -> None:
        self._models.check_open()


class _NotFound(Exception):
    """A re-attach found no such train call (the server restarted before it finished)."""
