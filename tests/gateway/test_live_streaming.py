"""Live streaming over a real socket: tokens leave as they are sampled, and a client that leaves stops its rows.

The gateway serves SmolLM2-135M on the continuously batched transformers engine (about 40 ms a token on two
CPU cores, so "before the 8th token" leaves room to measure). Time is measured with the engine's own step
counter, not the wall clock: with one request in flight, each decode step samples one of its tokens.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from agents import Agent, ModelBehaviorError, ModelSettings, RunConfig, Runner
from agents.models.openai_responses import OpenAIResponsesModel
from fakes import post_scope, receive_body

from art_core.engines.base import SamplingParams
from art_core.engines.transformers import TransformersEngine
from art_core.gateway import Gateway, GatewaySettings

pytestmark = pytest.mark.asyncio(loop_scope="module")

LONG = [{"role": "user", "content": "Count from 1 to 200, separated by commas."}]  # more than 64 tokens
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Gateway]:
    engine = await TransformersEngine.from_pretrained(smollm2_dir, device="cpu")
    try:
        settings = GatewaySettings(model_name="agent", records_path=tmp_path_factory.mktemp("live") / "records.jsonl")
        async with Gateway(engine, settings) as gw:
            yield gw
    finally:
        await engine.aclose()


def client(gateway: Gateway, rollout: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.rollout_base_url(rollout), api_key="unused", max_retries=0)


def steps(gateway: Gateway) -> int:
    return int(gateway.engine.stats["steps"])  # type: ignore[attr-defined]


async def rows_freed(gateway: Gateway, timeout: float = 120.0) -> bool:
    """Whether the engine's batch empties within ``timeout`` seconds (a bound for a hang: on a loaded machine the
    decode thread may take seconds to reach its next step)."""
    for _ in range(int(timeout / 0.02)):
        if gateway.engine.running_rows == 0:  # type: ignore[attr-defined]
            return True
        await asyncio.sleep(0.02)
    return False


async def assert_greedy_prefix(gateway: Gateway, record: Any) -> None:
    """The record holds exactly the first tokens the model samples greedily for its prompt, with their logprobs."""
    k = len(record.completion_token_ids)
    (alone,) = await gateway.engine.generate(record.prompt_token_ids, SamplingParams(max_tokens=k, temperature=0))
    assert record.completion_token_ids == alone.token_ids
    assert record.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


async def test_openai_client_gets_the_first_chunk_before_the_8th_token(gateway: Gateway):
    start = steps(gateway)
    first: int | None = None
    text = []
    async with client(gateway, "live-chat") as api:
        stream = await api.chat.completions.create(model="agent", messages=LONG, max_tokens=64, temperature=0,
                                                   stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = steps(gateway) - start if first is None else first
                text.append(chunk.choices[0].delta.content)
    (record,) = gateway.records.for_rollout("live-chat")
    assert len(record.completion_token_ids) == 64 and record.finish_reason == "length"
    assert first is not None and first < 8, f"the first content chunk came after {first} tokens were sampled"
    assert "".join(text) == gateway.engine.tokenizer.decode(record.completion_token_ids, skip_special_tokens=True)


async def test_agents_sdk_run_streamed_gets_the_first_delta_before_the_8th_token(gateway: Gateway):
    async with client(gateway, "live-agent") as api:
        agent = Agent(name="Counter", instructions="You count.", model=OpenAIResponsesModel("agent", api),
                      model_settings=ModelSettings(temperature=0, max_tokens=64))
        start = steps(gateway)
        first: int | None = None
        result = Runner.run_streamed(agent, LONG[0]["content"], run_config=RunConfig(tracing_disabled=True))
        # Cut at max_tokens, the response ends "incomplete", which the SDK reports as an error at the end.
        with pytest.raises(ModelBehaviorError, match="max_output_tokens"):
            async for event in result.stream_events():
                if event.type == "raw_response_event" and event.data.type == "response.output_text.delta":
                    first = steps(gateway) - start if first is None else first
    (record,) = gateway.records.for_rollout("live-agent")
    assert len(record.completion_token_ids) == 64 and record.endpoint == "responses"
    assert first is not None and first < 8, f"the first text delta came after {first} tokens were sampled"


async def test_streamed_tool_call_deltas_reassemble_to_the_recorded_call(gateway: Gateway):
    calls: dict[int, dict[str, Any]] = {}
    async with client(gateway, "live-tools") as api:
        stream = await api.chat.completions.create(
            model="agent", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0, max_tokens=100,
            stream=True)
        finish = None
        async for chunk in stream:
            choice = chunk.choices[0]
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
    (record,) = gateway.records.for_rollout("live-tools")
    recorded = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                for c in record.reply["tool_calls"]]
    assert [calls[i] for i in sorted(calls)] == recorded and len(recorded) >= 1
    assert recorded[0]["name"] == "get_weather" and isinstance(json.loads(recorded[0]["arguments"]), dict)
    assert finish == record.finish_reason == "tool_calls"


async def test_a_client_that_leaves_mid_stream_frees_its_row_and_its_call_is_recorded_cancelled(gateway: Gateway):
    async with client(gateway, "live-gone") as api:
        stream = await api.chat.completions.create(model="agent", messages=LONG, max_tokens=400, temperature=0,
                                                   stream=True)
        received = 0
        async for chunk in stream:
            received += bool(chunk.choices and chunk.choices[0].delta.content)
            if received == 3:
                break
        await stream.close()  # the connection goes: the gateway hears the disconnect
        assert await rows_freed(gateway), "the batch row of the abandoned stream was not freed"
    before = steps(gateway)
    await asyncio.sleep(0.3)
    assert steps(gateway) == before  # nothing is decoded any more
    (record,) = gateway.records.for_rollout("live-gone")
    assert record.finish_reason == "cancelled" and 3 <= len(record.completion_token_ids) < 400
    assert gateway.metrics.completions_cancelled >= 1
    await assert_greedy_prefix(gateway, record)  # the tokens sampled so far, token-exact
    record.to_call_record()  # trainable as it is


async def test_a_non_streaming_call_whose_task_is_cancelled_is_recorded_cancelled(gateway: Gateway):
    body = {"model": "agent", "messages": LONG, "max_tokens": 400, "temperature": 0}
    async with httpx.AsyncClient(timeout=60) as http:
        start = steps(gateway)
        call = asyncio.create_task(http.post(f"{gateway.rollout_base_url('live-cancel')}/chat/completions", json=body))
        for _ in range(6000):  # until a few tokens are in, by the engine's count (at most a minute)
            if steps(gateway) - start >= 3:
                break
            await asyncio.sleep(0.01)
        call.cancel()  # as a rollout's timeout does: the connection goes with the task
        with pytest.raises(asyncio.CancelledError):
            await call
    assert await rows_freed(gateway)
    (record,) = gateway.records.for_rollout("live-cancel")
    assert record.finish_reason == "cancelled" and 3 <= len(record.completion_token_ids) < 400
    await assert_greedy_prefix(gateway, record)


async def test_a_client_that_stops_reading_does_not_hold_a_training_pause(gateway: Gateway):
    """The app is called over ASGI with a ``send`` that blocks after the first chunk, as a server's does when
    the client stops reading and the socket buffers are full (too large to fill reliably over loopback)."""
    body = json.dumps({"model": "agent", "messages": LONG, "max_tokens": 24, "temperature": 0,
                       "stream": True}).encode()
    scope = post_scope("/rollouts/slow-reader/v1/chat/completions", body, port=gateway.port)
    first_chunk, reader_back, sent = asyncio.Event(), asyncio.Event(), []
    receive = receive_body(body)  # the client never leaves

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            sent.append(message["body"])
            if not first_chunk.is_set():
                first_chunk.set()
                await reader_back.wait()  # the client stops reading here

    request = asyncio.create_task(gateway.app(scope, receive, send))
    await asyncio.wait_for(first_chunk.wait(), 60)
    # The engine finishes the 24 tokens on its own; the pause must not wait for the reader.
    await asyncio.wait_for(gateway.pause_for_training(), 30)
    assert gateway.control.in_flight == 0
    await gateway.resume_after_training(gateway.engine.adapter_step)
    reader_back.set()
    await asyncio.wait_for(request, 30)
    (record,) = gateway.records.for_rollout("slow-reader")
    assert record.finish_reason == "length" and len(record.completion_token_ids) == 24
    assert b"[DONE]" in sent[-1] or any(b"[DONE]" in chunk for chunk in sent)
    await assert_greedy_prefix(gateway, record)
