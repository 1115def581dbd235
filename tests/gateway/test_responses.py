"""/v1/responses over a real socket: the official openai client, raw SSE, and the OpenAI Agents SDK for real.

Most tests use the fake engine from ``fakes.py`` (deterministic text and tool calls); one set runs the tiny
random Qwen2 through ``TransformersEngine``.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from art_core.gateway import Gateway

from fakes import TOOL_REPLY, WEATHER_TOOL, FakeEngine

TOOL = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses API's flat function tool
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


def async_client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)


async def post(gateway: Gateway, body: dict[str, Any], *, path: str = "/v1/responses") -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(f"{gateway.url}{path}", json=body)


def sse_events(text: str) -> list[dict[str, Any]]:
    """Parse an SSE body, checking each ``event:`` line names its data's ``type``."""
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        events.append(data)
    return events


def replies_after_tool(final: str) -> Any:
    """Fake model: call get_weather first; once a tool response is in the prompt, answer ``final``."""

    def reply(prompt_ids: list[int], params: Any, index: int, *, engine: FakeEngine) -> str:
        return final if "<tool_response>" in engine.tokenizer.decode(prompt_ids) else TOOL_REPLY

    return reply


# --- official client, non-streaming -------------------------------------------------------------------


async def test_string_input(gateway: Gateway, engine: FakeEngine):
    async with async_client(gateway.base_url) as client:
        response = await client.responses.create(model="agent", input="Hi!", max_output_tokens=50, temperature=0.5)
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    assert response.output_text == "Hello there! How can I help?" and response.model == "agent"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    prompt_ids, params = engine.calls[0]
    expected = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)
    assert prompt_ids == expected
    assert (params.max_tokens, params.temperature, params.top_p, params.n) == (50, 0.5, 1.0, 1)
    completion = len(engine.tokenizer.encode(engine.reply, add_special_tokens=False)) + 1  # + <|im_end|>
    assert (response.usage.input_tokens, response.usage.output_tokens) == (len(prompt_ids), completion)
    assert response.usage.total_tokens == len(prompt_ids) + completion


async def test_response_validates_against_the_openai_type(gateway: Gateway, engine: FakeEngine):
    engine.reply = "Let me check. " + TOOL_REPLY
    reply = await post(gateway, {"model": "agent", "input": "Hi!", "tools": [TOOL], "instructions": "Be brief.",
                                 "metadata": {"k": "v"}})
    assert reply.status_code == 200
    response = Response.model_validate(reply.json())  # strict validation, not the client's lenient parsing
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.instructions == "Be brief." and response.metadata == {"k": "v"} and response.tools[0].name == "get_weather"
    assert response.tool_choice == "auto" and response.parallel_tool_calls is True and response.text.format.type == "text"


async def test_items_render_exactly_like_the_chat_equivalent(gateway: Gateway, engine: FakeEngine):
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                        {"type": "input_text", "text": "in Paris?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check.",
                                                              "annotations": []}], "id": "msg_1", "status": "completed"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "20 C"}]},
    ]
    chat_messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "20 C"},
    ]
    async with async_client(gateway.base_url) as client:
        await client.responses.create(model="agent", instructions="Be brief.", input=items, tools=[TOOL])
        await client.chat.completions.create(model="agent", messages=chat_messages, tools=[WEATHER_TOOL])
    responses_prompt, chat_prompt = engine.calls[0][0], engine.calls[1][0]
    assert responses_prompt == chat_prompt  # the same template, tools and messages as chat.py
    text = engine.tokenizer.decode(responses_prompt)
    assert "Let me check.\n<tool_call>" in text and "<tool_response>\n20 C\n</tool_response>" in text


async def test_tool_call_and_round_trip(gateway: Gateway, engine: FakeEngine):
    engine.reply = TOOL_REPLY
    async with async_client(gateway.base_url) as client:
        first = await client.responses.create(model="agent", input="Weather in Paris?", tools=[TOOL])
        (call,) = first.output  # no text: no message item
        assert call.type == "function_call" and call.id.startswith("fc_") and call.call_id.startswith("call_")
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.status == "completed"
        engine.reply = "It is 18 C in Paris."
        history = [{"role": "user", "content": "Weather in Paris?"}, *[item.model_dump() for item in first.output],
                   {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}]
        second = await client.responses.create(model="agent", input=history, tools=[TOOL])
    assert second.output_text == "It is 18 C in Paris." and second.status == "completed"
    first_record, second_record = gateway.records.for_rollout(None)
    assert first_record.finish_reason == "tool_calls" and second_record.finish_reason == "stop"
    # The model's own call, sent back, re-renders token for token: the next prompt extends the last exchange.
    exchange = first_record.prompt_token_ids + first_record.completion_token_ids
    assert second_record.prompt_token_ids[: len(exchange)] == exchange


async def test_tool_choice_none_hides_tools(gateway: Gateway, engine: FakeEngine):
    engine.reply = TOOL_REPLY
    async with async_client(gateway.base_url) as client:
        response = await client.responses.create(model="agent", input="Hi", tools=[TOOL], tool_choice="none")
    assert response.output_text == TOOL_REPLY and [i.type for i in response.output] == ["message"]
    assert "<tools>" not in engine.tokenizer.decode(engine.calls[0][0])


async def test_structured_output_reaches_the_engine(gateway: Gateway, engine: FakeEngine):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    engine.reply = '{"answer": 4}'
    async with async_client(gateway.base_url) as client:
        response = await client.responses.create(model="agent", input="2+2?", text={"format": {
            "type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
        await client.responses.create(model="agent", input="2+2?", text={"format": {"type": "json_object"}})
        await client.responses.create(model="agent", input="2+2?", text={"format": {"type": "text"}})
    assert json.loads(response.output_text) == {"answer": 4} and response.text.format.type == "json_schema"
    assert [params.json_schema for _, params in engine.calls] == [schema, {"type": "object"}, None]


async def test_max_output_tokens_gives_an_incomplete_response(gateway: Gateway, engine: FakeEngine):
    engine.reply = "one two three four five six seven"
    reply = await post(gateway, {"model": "agent", "input": "Count", "max_output_tokens": 3})
    response = Response.model_validate(reply.json())
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 3
    assert gateway.records.for_rollout(None)[0].finish_reason == "length"


async def test_logprobs_when_included(gateway: Gateway, engine: FakeEngine):
    engine.reply = "Hi 🙂"
    async with async_client(gateway.base_url) as client:
        plain = await client.responses.create(model="agent", input="Hi")
        response = await client.responses.create(model="agent", input="Hi", top_logprobs=2,
                                                  include=["message.output_text.logprobs"])
    assert plain.output[0].content[0].logprobs == []
    entries = response.output[0].content[0].logprobs
    assert len(entries) == len(engine.tokenizer.encode("Hi 🙂", add_special_tokens=False))  # end-of-turn left out
    assert [e.logprob for e in entries] == pytest.approx([-0.5 - 0.01 * k for k in range(len(entries))])
    assert b"".join(bytes(e.bytes) for e in entries).decode() == "Hi 🙂"
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob for e in entries)
    assert engine.calls[1][1].top_logprobs == 2


# --- streaming ---------------------------------------------------------------------------------------


async def test_stream_events_in_order_and_valid(gateway: Gateway, engine: FakeEngine):
    engine.reply = "Let me check the weather. " + TOOL_REPLY
    reply = await post(gateway, {"model": "agent", "input": "Weather?", "tools": [TOOL], "stream": True})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = sse_events(reply.text)
    for event in events:
        STREAM_EVENT.validate_python(event)  # each one is a valid openai stream event
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 3  # really split, token by token
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = Response.model_validate(events[-1]["response"])
    assert text == final.output_text == "Let me check the weather."
    assert events[-3]["arguments"] == final.output[1].arguments and final.output[1].name == "get_weather"
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert {e["response"]["id"] for e in (events[0], events[1], events[-1])} == {final.id}


async def test_stream_with_the_client_and_its_accumulator(gateway: Gateway, engine: FakeEngine):
    engine.reply = "Streaming works, token by token: 🙂 done."
    async with async_client(gateway.base_url) as client:
        stream = await client.responses.create(model="agent", input="Hi", stream=True)
        events = [event async for event in stream]
        # client.responses.stream() rebuilds the response from the events and checks item identities.
        async with client.responses.stream(model="agent", input="Hi") as managed:
            final = await managed.get_final_response()
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == final.output_text == engine.reply
    assert events[-1].type == "response.completed" and events[-1].response.usage.output_tokens > 0
    assert len(gateway.records.for_rollout(None)) == 2


async def test_stream_cut_at_max_output_tokens_ends_incomplete(gateway: Gateway, engine: FakeEngine):
    engine.reply = "one two three four five six seven"
    events = sse_events((await post(gateway, {"model": "agent", "input": "Count", "max_output_tokens": 3,
                                              "stream": True})).text)
    assert events[-1]["type"] == "response.incomplete"
    assert Response.model_validate(events[-1]["response"]).incomplete_details.reason == "max_output_tokens"


async def test_stream_logprobs_add_up(gateway: Gateway, engine: FakeEngine):
    engine.reply = "Several tokens in this reply."
    events = sse_events((await post(gateway, {"model": "agent", "input": "Hi", "stream": True,
                                              "include": ["message.output_text.logprobs"]})).text)
    entries = [e for ev in events if ev["type"] == "response.output_text.delta" for e in ev["logprobs"]]
    assert "".join(e["token"] for e in entries) == engine.reply
    assert len(entries) == len(engine.tokenizer.encode(engine.reply, add_special_tokens=False))


# --- records -----------------------------------------------------------------------------------------


async def test_records_per_rollout(gateway: Gateway, engine: FakeEngine):
    body = {"model": "agent", "input": "Hi", "store": False, "reasoning": {"effort": "low"}, "truncation": "auto"}
    async with async_client(gateway.rollout_base_url("r-1")) as client:
        first = await client.responses.create(**body)
    reply = await post(gateway, body, path="/rollouts/r-2/v1/responses")
    async with httpx.AsyncClient() as http:
        header = await http.post(f"{gateway.base_url}/responses", json=body, headers={"X-Rollout-Id": "r-2"})
        listed = (await http.get(f"{gateway.url}/rollouts/r-1/records")).json()
    (record,) = gateway.records.for_rollout("r-1")
    assert record.endpoint == "responses" and record.request_id == first.id and record.rollout_id == "r-1"
    assert record.request == body and record.finish_reason == "stop" and record.model == "agent"
    assert record.prompt_token_ids == engine.calls[0][0]
    assert engine.tokenizer.decode(record.completion_token_ids, skip_special_tokens=True) == first.output_text
    assert len(record.logprobs) == len(record.completion_token_ids)
    assert set(record.timings) >= {"wait", "queue", "generate", "total"}
    assert [r.request_id for r in gateway.records.for_rollout("r-2")] == [reply.json()["id"], header.json()["id"]]
    assert listed[0]["request_id"] == first.id and listed[0]["endpoint"] == "responses"
    assert gateway.records.for_rollout(None) == []


# --- the OpenAI Agents SDK ---------------------------------------------------------------------------


def weather_agent(base_url: str, seen: list[str], **kwargs: Any) -> Any:
    from agents import Agent, function_tool
    from agents.models.openai_responses import OpenAIResponsesModel

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        seen.append(city)
        return f"18 C and cloudy in {city}"

    model = OpenAIResponsesModel(model="agent", openai_client=async_client(base_url))
    return Agent(name="forecaster", instructions="Answer weather questions with the tool.", tools=[get_weather],
                 model=model, **kwargs)


async def test_agents_sdk_runs_a_tool_then_answers(gateway: Gateway, engine: FakeEngine):
    from agents import RunConfig, Runner

    engine.reply = lambda prompt, params, i: replies_after_tool("It is 18 C in Paris.")(prompt, params, i, engine=engine)
    seen: list[str] = []
    result = await Runner.run(weather_agent(gateway.rollout_base_url("agent-1"), seen), "Weather in Paris?",
                              run_config=RunConfig(tracing_disabled=True))
    assert seen == ["Paris"] and result.final_output == "It is 18 C in Paris."
    first, second = gateway.records.for_rollout("agent-1")
    assert (first.finish_reason, second.finish_reason) == ("tool_calls", "stop")
    assert first.request["instructions"] == "Answer weather questions with the tool."
    assert [item.get("type") for item in second.request["input"]] == [None, "function_call", "function_call_output"]
    prompt = engine.tokenizer.decode(second.prompt_token_ids)
    assert "<tool_response>\n18 C and cloudy in Paris\n</tool_response>" in prompt
    exchange = first.prompt_token_ids + first.completion_token_ids
    assert second.prompt_token_ids[: len(exchange)] == exchange  # the trainer can merge the turns by prefix


async def test_agents_sdk_streamed_run(gateway: Gateway, engine: FakeEngine):
    from agents import RunConfig, Runner

    engine.reply = lambda prompt, params, i: replies_after_tool("Sunny enough, 18 C.")(prompt, params, i, engine=engine)
    seen: list[str] = []
    result = Runner.run_streamed(weather_agent(gateway.base_url, seen), "Weather in Paris?",
                                 run_config=RunConfig(tracing_disabled=True))
    raw_types, text = [], ""
    async for event in result.stream_events():
        if event.type == "raw_response_event":
            raw_types.append(event.data.type)
            if event.data.type == "response.output_text.delta":
                text += event.data.delta
    assert seen == ["Paris"] and result.final_output == "Sunny enough, 18 C." == text
    assert raw_types.count("response.completed") == 2 and "response.function_call_arguments.done" in raw_types
    assert [r.endpoint for r in gateway.records.for_rollout(None)] == ["responses", "responses"]


async def test_agents_sdk_structured_output(gateway: Gateway, engine: FakeEngine):
    from agents import Agent, RunConfig, Runner
    from agents.models.openai_responses import OpenAIResponsesModel

    class Answer(BaseModel):
        answer: int

    engine.reply = '{"answer": 4}'
    agent = Agent(name="math", output_type=Answer,
                  model=OpenAIResponsesModel(model="agent", openai_client=async_client(gateway.base_url)))
    result = await Runner.run(agent, "2+2?", run_config=RunConfig(tracing_disabled=True))
    assert result.final_output == Answer(answer=4)
    assert engine.calls[0][1].json_schema["properties"] == {"answer": {"title": "Answer", "type": "integer"}}


# --- bad requests ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("extra", "status", "needle"), [
    ({"previous_response_id": "resp_1"}, 400, "stateless"),
    ({"conversation": "conv_1"}, 400, "stateless"),
    ({"background": True}, 400, "background responses are not supported"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input[0] has type 'reasoning': this gateway accepts "
                                                               "message, function_call, function_call_output"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "stores no items"),
    ({"input": [{"content": "no role"}]}, 400, "input[0] has type None"),
    ({"input": ["text"]}, 400, "input[0] is a str"),
    ({"input": []}, 400, "input is an empty list"),
    ({"input": 5}, 400, "input must be a string or a list of items, got int"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "input[0].call_id: Field required"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, 400, "no function_call item"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0].role"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0] has type 'web_search'"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, 400, "tools[0].name"),
    ({"tools": [TOOL, TOOL]}, 400, "function names must be unique"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, 400, "'nope', which is not in tools"),
    ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": 5}}}}, 400, "not a valid JSON Schema"),
    ({"max_output_tokens": 10**6}, 400, "max_output_tokens is 1000000, above this gateway's limit"),
    ({"temperature": 3}, 400, "temperature"),
    ({"model": "nope"}, 404, "does not exist here"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, 422, "text only"),
])
async def test_bad_requests_are_clear(gateway: Gateway, engine: FakeEngine, extra: dict[str, Any], status: int, needle: str):
    reply = await post(gateway, {"model": "agent", "input": "Hi", **extra})
    assert reply.status_code == status, reply.text
    assert needle in reply.json()["error"]["message"]
    assert engine.calls == [] and len(gateway.records) == 0


async def test_malformed_body(gateway: Gateway):
    async with httpx.AsyncClient() as http:
        not_json = await http.post(f"{gateway.base_url}/responses", content=b"{nope", headers={"Content-Type": "application/json"})
        not_object = await http.post(f"{gateway.base_url}/responses", json=[1, 2])
        no_input = await http.post(f"{gateway.base_url}/responses", json={"model": "agent"})
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    assert not_object.status_code == 400 and "must be a JSON object" in not_object.json()["error"]["message"]
    assert no_input.status_code == 400 and no_input.json()["error"]["param"] == "input"


async def test_stateless_error_through_the_client(gateway: Gateway):
    async with async_client(gateway.base_url) as client:
        with pytest.raises(openai.BadRequestError, match="send the whole conversation in input"):
            await client.responses.create(model="agent", input="Hi", previous_response_id="resp_123")


# --- a real model ------------------------------------------------------------------------------------


async def test_tiny_model_non_streaming_and_streaming_agree(tiny_gateway: Gateway):
    async with async_client(tiny_gateway.rollout_base_url("tiny")) as client:
        response = await client.responses.create(model="agent", input="Hi!", max_output_tokens=12, temperature=0,
                                                 tools=[TOOL])
        stream = await client.responses.create(model="agent", input="Hi!", max_output_tokens=12, temperature=0,
                                               tools=[TOOL], stream=True)
        events = [event async for event in stream]
    Response.model_validate(response.model_dump())
    streamed = events[-1].response
    assert events[-1].type == f"response.{response.status}" and streamed.status == response.status  # greedy: same run
    assert streamed.output_text == response.output_text
    plain, again = tiny_gateway.records.for_rollout("tiny")
    assert plain.completion_token_ids == again.completion_token_ids and plain.endpoint == "responses"
    assert response.usage.output_tokens == len(plain.completion_token_ids) <= 12
    assert len(plain.logprobs) == len(plain.completion_token_ids) and all(lp <= 0 for lp in plain.logprobs)
