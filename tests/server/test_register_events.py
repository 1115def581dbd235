"""A registration follows the server's ``loading`` events, so a load of any length never meets the client's timeout.

A load on a server takes as long as the model and the machine make it: a large model, or Ray actors starting on
a busy machine (seen: `RemoteBackend.register` raised `ReadTimeout` after 60 s while a loaded machine started a
Ray-served model). Here the server runs in this process over a ``LocalBackend`` whose loads wait on a gate the
test holds, so "a load still under way" holds as long as the test wants, on any machine.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from art_core import LifecycleError, LocalBackend, LoraSettings, RemoteBackend, TrainableModel
from art_core.backends.base import ModelSpec
from art_core.gateway.listen import bind, start_server
from art_core.server.app import create_server_app
from art_core.wire import API_PREFIX, gateway_path

pytestmark = pytest.mark.asyncio(loop_scope="module")


class HeldLoads(LocalBackend):
    """A ``LocalBackend`` whose registrations wait for ``gate`` before they load (a long load, held by the test)."""

    def __init__(self, path: Path, url: str) -> None:
        super().__init__(path=path, show_progress=False,
                         gateway_mount=lambda spec: url + gateway_path(spec.project, spec.name))
        self.gate, self.loads = asyncio.Event(), 0

    async def register(self, model: ModelSpec) -> int:
        self.loads += 1
        await self.gate.wait()
        return await super().register(model)


@dataclass
class Served:
    url: str
    backend: HeldLoads


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    sock = bind("127.0.0.1", 0, fix="")
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    backend = HeldLoads(tmp_path_factory.mktemp("held"), url)
    app = create_server_app(backend, token=None, max_body_bytes=1 << 20, heartbeat=0.01)
    server, task = await start_server(app, sock, failed=lambda error: RuntimeError(f"no server: {error}"))
    try:
        yield Served(url, backend)
    finally:
        backend.gate.set()
        server.should_exit = True
        await task
        await backend.aclose()
        sock.close()


async def _events(response: httpx.Response) -> AsyncIterator[tuple[str, dict]]:
    kind = ""
    async for line in response.aiter_lines():
        if line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            yield kind, json.loads(line[5:])


async def test_a_held_load_streams_loading_events_until_the_model_is_registered(served: Served, tiny_model_dir):
    spec = TrainableModel(name="held", project="events", base_model=tiny_model_dir).spec
    served.backend.gate.clear()
    seen: list[str] = []
    async with httpx.AsyncClient(timeout=60) as http, http.stream(
            "POST", served.url + API_PREFIX + "/models", content=spec.model_dump_json(),
            headers={"Accept": "text/event-stream"}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        async for kind, data in _events(response):
            seen.append(kind)
            if seen.count("loading") == 3:  # three heartbeats while the load is held: let it finish
                served.backend.gate.set()
            if kind == "registered":
                assert data["step"] == 0 and data["model_dir"].endswith("held")
    assert seen[:3] == ["loading"] * 3 and seen[-1] == "registered" and set(seen) == {"loading", "registered"}


async def test_remote_backend_registers_through_the_events_and_raises_the_servers_error(served: Served,
                                                                                        tiny_model_dir):
    served.backend.gate.clear()
    loads = served.backend.loads
    model = TrainableModel(name="remote", project="events", base_model=tiny_model_dir)
    async with RemoteBackend(served.url, show_progress=False) as backend:
        registering = asyncio.ensure_future(model.register(backend))
        while served.backend.loads == loads:  # until the server has begun the load
            assert not registering.done(), registering
            await asyncio.sleep(0.01)
        assert not registering.done()  # held: the client follows the events, it does not give up
        served.backend.gate.set()
        await registering
        assert model.step == 0
    other = TrainableModel(name="remote", project="events", base_model=tiny_model_dir, lora=LoraSettings(rank=4))
    async with RemoteBackend(served.url, show_progress=False) as backend:
        with pytest.raises(LifecycleError, match="already registered on this server with another spec"):
            await other.register(backend)


async def test_a_client_that_leaves_mid_load_does_not_cut_it(served: Served, tiny_model_dir):
    spec = TrainableModel(name="left", project="events", base_model=tiny_model_dir).spec
    served.backend.gate.clear()
    loads = served.backend.loads
    async with httpx.AsyncClient(timeout=60) as http, http.stream(
            "POST", served.url + API_PREFIX + "/models", content=spec.model_dump_json(),
            headers={"Accept": "text/event-stream"}) as response:
        async for kind, _ in _events(response):
            assert kind == "loading"
            break  # the client leaves while the load is held
    assert served.backend.loads == loads + 1
    served.backend.gate.set()
    model = TrainableModel(name="left", project="events", base_model=tiny_model_dir)
    async with RemoteBackend(served.url, show_progress=False) as backend:
        await model.register(backend)  # attached to the load the first client started
        assert model.step == 0
    assert served.backend.loads == loads + 1  # loaded once
