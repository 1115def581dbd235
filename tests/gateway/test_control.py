"""The training handshake: requests wait while paused, and resume checks the adapter step."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest
from fakes import FakeEngine

from art_core.errors import CheckpointError, LifecycleError
from art_core.gateway import Gateway

USER = [{"role": "user", "content": "Hi!"}]


async def test_request_sent_while_paused_completes_after_resume(gateway: Gateway, engine: FakeEngine):
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="k", max_retries=0) as client:
        await gateway.pause_for_training()
        assert engine.paused
        held = asyncio.create_task(client.chat.completions.create(model="agent", messages=USER))
        await asyncio.sleep(0.3)
        assert not held.done() and engine.calls == []  # waiting, not failed
        engine.step = 1  # the trainer wrote checkpoint 1 and the engine serves it
        await gateway.resume_after_training(1)
        reply = await asyncio.wait_for(held, 10)
    assert reply.system_fingerprint == "adapter-1" and not engine.paused
    (record,) = gateway.records.for_rollout(None)
    assert record.adapter_step == 1 and record.timings["wait"] > 0.1


async def test_pause_lets_in_flight_requests_finish(gateway: Gateway, engine: FakeEngine):
    engine.delay = 0.3
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="k", max_retries=0) as client:
        in_flight = asyncio.create_task(client.chat.completions.create(model="agent", messages=USER))
        while not engine.calls:
            await asyncio.sleep(0.01)
        await gateway.pause_for_training()  # returns once the in-flight request is done with the engine
        assert gateway.control.in_flight == 0 and engine.paused
        assert (await in_flight).choices[0].message.content
        await gateway.resume_after_training(0)


async def test_wrong_step_keeps_requests_held(gateway: Gateway, engine: FakeEngine, tmp_path: Path):
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="k", max_retries=0) as client:
        await gateway.pause_for_training()
        held = asyncio.create_task(client.chat.completions.create(model="agent", messages=USER))
        with pytest.raises(CheckpointError, match="engine serves adapter 0, expected 5: checkpoint 0005"):
            await gateway.resume_after_training(5)
        await asyncio.sleep(0.2)
        assert not held.done() and gateway.control.state == "paused"
        await gateway.resume_after_training(5, adapter_path=tmp_path / "0005")  # loads it, then checks
        assert (await asyncio.wait_for(held, 10)).system_fingerprint == "adapter-5"


async def test_handshake_order_is_enforced(gateway: Gateway):
    with pytest.raises(LifecycleError, match="pause_for_training"):
        await gateway.resume_after_training(0)
    await gateway.pause_for_training()
    with pytest.raises(LifecycleError, match="paused"):
        await gateway.pause_for_training()
    await gateway.resume_after_training(0)


async def test_closing_answers_held_requests_503(engine: FakeEngine):
    gateway = await Gateway(engine).start()
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        await gateway.pause_for_training()
        held = asyncio.create_task(http.post("/v1/chat/completions", json={"model": "agent", "messages": USER}))
        await asyncio.sleep(0.2)
        await gateway.aclose()
        response = await asyncio.wait_for(held, 10)
    assert response.status_code == 503 and response.json()["error"]["code"] == "gateway_closed"
