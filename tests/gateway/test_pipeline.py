"""The completion pipeline (``gateway/completion.py``) from its typed input, and its two ways of answering.

The pipeline takes a ``CompletionInput`` (no HTTP request); ``answers()`` and ``events()`` read the engine
through one loop and record the same way. A stream cut after its last token arrived, but before its
records were written, keeps them (with the finish reasons the engine gave).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fakes import TOOL_REPLY, WEATHER_TOOL, FakeEngine, post_scope, receive_body

from art_core.engines.base import SamplingParams
from art_core.gateway import Gateway
from art_core.gateway.completion import Answer, Completion, CompletionInput, Done

USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def weather_call(request_id: str, *, n: int = 2, top_logprobs: int = 2) -> CompletionInput:
    return CompletionInput(
        endpoint="chat.completions", request_id=request_id, model="agent", messages=USER, tools=[WEATHER_TOOL],
        tool_names=["get_weather"], params=SamplingParams(max_tokens=200, n=n, top_logprobs=top_logprobs),
        top_logprobs=top_logprobs, raw={"model": "agent", "messages": USER, "tools": [WEATHER_TOOL]},
        rollout_id="pipeline", caller="planner")


async def test_answers_and_events_give_the_same_answers_and_records(gateway: Gateway, engine: FakeEngine):
    engine.reply = lambda prompt, params, i: TOOL_REPLY if i == 0 else "Sunny, 21 degrees."
    state = gateway.app.state.gateway
    answered = await Completion(state, weather_call("call-a")).answers()
    streamed = [event async for event in Completion(state, weather_call("call-b")).events()]
    done = [event.answer for event in streamed if isinstance(event, Done)]

    def without_ids(answer: Answer) -> tuple[Any, ...]:  # tool-call ids are fresh per call
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in answer.tool_calls]
        return (answer.index, answer.content, calls, answer.finish_reason, answer.logprobs,
                answer.completion_tokens, answer.adapter_step)

    assert [without_ids(a) for a in answered] == [without_ids(a) for a in done]
    assert answered[0].finish_reason == "tool_calls" and answered[0].tool_calls[0].function.name == "get_weather"
    assert answered[1].content == "Sunny, 21 degrees." and answered[1].finish_reason == "stop"
    records = gateway.records.for_rollout("pipeline")
    assert [(r.request_id, r.choice_index) for r in records] == [
        ("call-a", 0), ("call-a", 1), ("call-b", 0), ("call-b", 1)]
    for a, b in ((records[0], records[2]), (records[1], records[3])):
        assert a.completion_token_ids == b.completion_token_ids and a.logprobs == b.logprobs
        assert a.finish_reason == b.finish_reason and a.caller == b.caller == "planner"
        assert a.messages == USER and a.tools == [WEATHER_TOOL] and a.endpoint == "chat.completions"
    assert state.control.in_flight == 0


async def test_a_stream_cut_after_its_last_token_keeps_its_record(gateway: Gateway, engine: FakeEngine):
    """The client leaves while the chunk of the last sampled token is being sent: every token has arrived
    and the choice has ended, but its record is written only after the tail. It is recorded, as it ended."""
    last = engine.tokenizer.decode(engine.tokenizer.encode(engine.reply, add_special_tokens=False)[2:3])
    body = json.dumps({"model": "agent", "messages": USER, "max_tokens": 3, "stream": True}).encode()
    scope = post_scope("/rollouts/cut-at-end/v1/chat/completions", body, port=gateway.port)
    last_chunk, gone = asyncio.Event(), asyncio.Event()
    receive = receive_body(body, leave=gone)

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and json.dumps(last).encode() in message.get("body", b""):
            last_chunk.set()
            await asyncio.Event().wait()  # the client never reads it: it leaves instead

    cancelled_before = gateway.metrics.completions_cancelled
    request = asyncio.create_task(gateway.app(scope, receive, send))
    await asyncio.wait_for(last_chunk.wait(), 30)
    gone.set()
    await asyncio.wait_for(request, 30)
    (record,) = gateway.records.for_rollout("cut-at-end")
    assert record.finish_reason == "length" and len(record.completion_token_ids) == 3
    assert gateway.metrics.completions_cancelled == cancelled_before  # it had ended: not counted as cut
    assert gateway.control.in_flight == 0
