"""Gateway lifecycle: start once, close once, nothing after; binds its own port; leaves signals alone."""

from __future__ import annotations

import signal

import httpx
import pytest
from fakes import FakeEngine

from art_core.errors import ConfigError, LifecycleError
from art_core.gateway import Gateway, GatewaySettings


async def test_lifecycle(engine: FakeEngine):
    handler_before = signal.getsignal(signal.SIGINT)
    gateway = Gateway(engine)
    with pytest.raises(LifecycleError, match="new gateway"):
        _ = gateway.base_url
    await gateway.start()
    port = gateway.port
    assert signal.getsignal(signal.SIGINT) is handler_before  # uvicorn did not take over Ctrl-C
    assert gateway.base_url == f"http://127.0.0.1:{gateway.port}/v1" and gateway.port > 0
    async with httpx.AsyncClient() as http:
        health = (await http.get(f"{gateway.url}/health")).json()
        assert health == {"state": "serving", "adapter_step": 0, "engine": {"ok": True}}
    with pytest.raises(LifecycleError, match="starts once"):
        await gateway.start()
    await gateway.aclose()
    await gateway.aclose()  # closing twice is fine
    with pytest.raises(LifecycleError, match="closed"):
        await gateway.start()
    with pytest.raises(LifecycleError, match="closed"):
        await gateway.pause_for_training()
    async with httpx.AsyncClient() as http:
        with pytest.raises(httpx.ConnectError):
            await http.get(f"http://127.0.0.1:{port}/health")


async def test_port_in_use_is_a_config_error(engine: FakeEngine):
    async with Gateway(engine) as first:
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{first.port}"):
            await Gateway(engine, GatewaySettings(port=first.port)).start()


async def test_close_before_start(engine: FakeEngine):
    gateway = Gateway(engine)
    await gateway.aclose()
    with pytest.raises(LifecycleError):
        await gateway.start()
