"""The training handshake: requests wait while paused, and resume checks the adapter step."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import openai
import pytest
from fakes import FakeEngine

from art_core.errors import CheckpointError, LifecycleError
from art_core.gateway import Gateway

USER = [{"role": "user", "content": "Hi!"}]


async def _until_held(gateway: Gateway, rollout_id: str, count: int = 1) -> None:
    """Wait until the gateway holds ``count`` of the rollout's requests (it says so at ``.../status``)."""
    while gateway.rollout_status(rollout_id).unanswered < count:
        await asyncio.sleep(0.01)


async def test_request_sent_while_paused_completes_after_resume(gateway: Gateway, engine: FakeEngine):
    async with openai.AsyncOpenAI(base_url=gateway.rollout_base_url("held"), api_key="k", max_retries=0) as client:
        await gateway.pause_for_training()
        assert engine.paused
        held = asyncio.create_task(client.chat.completions.create(model="agent", messages=USER))
        await _until_held(gateway, "held")
        held_since = time.perf_counter()
        assert not held.done() and engine.calls == []  # waiting, not failed
        engine.step = 1  # the trainer wrote checkpoint 1 and the engine serves it
        held_for = time.perf_counter() - held_since
        await gateway.resume_after_training(1)
        reply = await asyncio.wait_for(held, 10)
    assert reply.system_fingerprint == "adapter-1" and not engine.paused
    (record,) = gateway.records.for_rollout("held")
    assert record.adapter_step == 1 and record.timings["wait"] >= held_for  # the record counts the time held


async def test_pause_lets_in_flight_requests_finish(gateway: Gateway, engine: FakeEngine):
    engine.gate = asyncio.Event()  # the call stays inside the engine until the test opens the gate
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="k", max_retries=0) as client:
        in_flight = asyncio.create_task(client.chat.completions.create(model="agent", messages=USER))
        while not engine.calls:
            await asyncio.sleep(0.01)
        pausing = asyncio.create_task(gateway.pause_for_training())
        while gateway.control.state != "paused":
            await asyncio.sleep(0.01)
        assert not pausing.done() and not engine.paused and gateway.control.in_flight == 1  # it waits for the call
        engine.gate.set()
        await pausing  # returns once the in-flight request is done with the engine
        assert gateway.control.in_flight == 0 and engine.paused
        assert (await in_flight).choices[0].message.content
        await gateway.resume_after_training(0)


async def test_wrong_step_keeps_requests_held(gateway: Gateway, engine: FakeEngine, tmp_path: Path):
    async with openai.AsyncOpenAI(base_url=gateway.rollout_base_url("held"), api_key="k", max_retries=0) as client:
        await gateway.pause_for_training()
        held = asyncio.create_task(client.chat.completions.create(model="agent", messages=USER))
        await _until_held(gateway, "held")
        with pytest.raises(CheckpointError, match="engine serves adapter 0, expected 5: checkpoint 0005"):
            await gateway.resume_after_training(5)
        for _ in range(10):  # the loop runs a few times: a request released by mistake would reach the engine
            await asyncio.sleep(0)
        assert not held.done() and engine.calls == [] and gateway.rollout_status("held").gateway == "paused"
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
        held = asyncio.create_task(http.post("/rollouts/held/v1/chat/completions",
                                             json={"model": "agent", "messages": USER}))
        await _until_held(gateway, "held")
        await gateway.aclose()
        response = await asyncio.wait_for(held, 10)
    assert response.status_code == 503 and response.json()["error"]["code"] == "gateway_closed"
