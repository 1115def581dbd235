"""Each record keeps the conversation as rendered, the reply as answered and the caller: what trajectories
are rebuilt from, on both endpoints."""

from __future__ import annotations

import httpx
from openai import AsyncOpenAI

from art_core.wire import encode_caller

from fakes import TOOL_REPLY, WEATHER_TOOL


async def test_chat_records_hold_the_conversation_reply_and_caller(gateway, engine):
    engine.reply = TOOL_REPLY
    client = AsyncOpenAI(base_url=gateway.rollout_base_url("r1"), api_key="x",
                         default_headers={"X-Art-Caller": "planner node"})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    reply = await client.chat.completions.create(model="agent", messages=messages, tools=[WEATHER_TOOL])

    (record,) = gateway.records.for_rollout("r1")
    assert record.messages == messages
    assert record.tools == [WEATHER_TOOL]
    call = reply.choices[0].message.tool_calls[0]
    assert record.reply["tool_calls"][0]["id"] == call.id  # the id the client got, so tool results link back
    assert record.reply["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": call.function.arguments}
    assert record.caller == "planner node" and record.to_call_record().caller == "planner node"


async def test_streamed_tool_calls_carry_the_recorded_ids(gateway, engine):
    engine.reply = TOOL_REPLY
    client = AsyncOpenAI(base_url=gateway.rollout_base_url("r2"), api_key="x")
    stream = await client.chat.completions.create(
        model="agent", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL], stream=True)
    ids = [tc.id async for chunk in stream for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices and tc.id]
    (record,) = gateway.records.for_rollout("r2")
    assert ids == [record.reply["tool_calls"][0]["id"]]


async def test_responses_records_hold_chat_format_messages(gateway, engine):
    engine.reply = TOOL_REPLY
    client = AsyncOpenAI(base_url=gateway.rollout_base_url("r3"), api_key="x")
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    response = await client.responses.create(model="agent", instructions="Be brief.", input="Weather in Paris?",
                                             tools=[tool])
    (record,) = gateway.records.for_rollout("r3")
    assert record.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    assert record.tools == [WEATHER_TOOL]
    assert record.reply["tool_calls"][0]["id"] == response.output[0].call_id


async def test_an_invalid_caller_header_is_a_400(gateway):
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        for value in ("a\tb", "a%09b", "x" * 201):  # a control character, sent as is or encoded; too long
            answer = await http.post("/v1/chat/completions", headers={"X-Art-Caller": value},
                                     json={"model": "agent", "messages": [{"role": "user", "content": "hi"}]})
            assert answer.status_code == 400 and "X-Art-Caller" in answer.json()["error"]["message"], value


async def test_a_caller_label_of_any_characters_reaches_the_record_as_it_was(gateway):
    """Headers carry ASCII: the adapters percent-encode a label (``encode_caller``), the gateway decodes it. A label
    over 200 characters is shortened by the encoder, not refused."""
    labels = ["équipe 写作/write", "50%_off", "a%20b", "node " * 50]
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        for i, label in enumerate(labels):
            answer = await http.post(f"/rollouts/lbl{i}/v1/chat/completions",
                                     headers={"X-Art-Caller": encode_caller(label)},
                                     json={"model": "agent", "messages": [{"role": "user", "content": "hi"}]})
            assert answer.status_code == 200, answer.text
    recorded = [gateway.records.for_rollout(f"lbl{i}")[0].caller for i in range(len(labels))]
    assert recorded == [*labels[:3], labels[3][:197] + "..."]
