"""/v1/chat/completions over a real socket, with the official openai client."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from art_core.gateway import Gateway

from fakes import TOOL_REPLY, WEATHER_TOOL, FakeEngine

USER = [{"role": "user", "content": "Hi!"}]


def async_client(gateway: Gateway, base_url: str | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url or gateway.base_url, api_key="unused", max_retries=0)


async def test_sync_client_non_streaming(gateway: Gateway, engine: FakeEngine):
    client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
    # The server runs in this event loop: the blocking client runs in a thread.
    reply = await asyncio.to_thread(client.chat.completions.create, model="agent", messages=USER, max_tokens=50)
    client.close()
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.model == "agent"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == "Hello there! How can I help?"
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].logprobs is None  # not asked for
    prompt_ids, params = engine.calls[0]
    completion_ids = engine.tokenizer.encode("Hello there! How can I help?", add_special_tokens=False)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == len(completion_ids) + 1  # + <|im_end|>
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert params.max_tokens == 50 and params.n == 1 and params.temperature == 1.0


async def test_prompt_is_the_chat_template_rendering(gateway: Gateway, engine: FakeEngine):
    async with async_client(gateway) as client:
        await client.chat.completions.create(
            model="agent", messages=[{"role": "developer", "content": "Be brief."}, *USER], temperature=0.0, seed=3,
            stop=["\n\n"], top_p=0.9, max_completion_tokens=20,
        )
    prompt_ids, params = engine.calls[0]
    expected = engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *USER], add_generation_prompt=True, tokenize=True,
        return_dict=False)
    assert prompt_ids == expected  # "developer" is rendered as the system turn
    assert (params.temperature, params.top_p, params.seed) == (0.0, 0.9, 3)
    assert (params.stop, params.max_tokens) == (("\n\n",), 20)


async def test_recorded_ids_decode_to_the_returned_text(gateway: Gateway, engine: FakeEngine):
    engine.reply = "Ünïcode 🙂 and spaces  ok"
    async with async_client(gateway) as client:
        reply = await client.chat.completions.create(model="agent", messages=USER)
    (record,) = gateway.records.for_rollout(None)
    text = engine.tokenizer.decode(record.completion_token_ids, skip_special_tokens=True)
    assert text == reply.choices[0].message.content == engine.reply
    call = record.to_call_record()
    assert call.completion_token_ids[-1] == engine.tokenizer.eos_token_id
    assert call.logprobs == pytest.approx([-0.5 - 0.01 * k for k in range(len(call.completion_token_ids))])
    assert call.request_id == reply.id and call.adapter_step == 0 and call.finish_reason == "stop"
    assert record.request["messages"] == USER and record.endpoint == "chat.completions"
    assert set(record.timings) >= {"wait", "queue", "generate", "total"}


async def test_async_streaming_reassembles_the_text(gateway: Gateway, engine: FakeEngine):
    engine.reply = "Streaming works, token by token: 🙂 done."
    async with async_client(gateway) as client:
        stream = await client.chat.completions.create(
            model="agent", messages=USER, stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 5  # really split, not one blob
    assert "".join(content) == engine.reply
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    (record,) = gateway.records.for_rollout(None)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(record.completion_token_ids)
    assert len({c.id for c in chunks}) == 1


async def test_stream_without_usage_has_no_usage_chunk(gateway: Gateway):
    async with async_client(gateway) as client:
        stream = await client.chat.completions.create(model="agent", messages=USER, stream=True)
        chunks = [chunk async for chunk in stream]
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


async def test_tool_call_non_streaming(gateway: Gateway, engine: FakeEngine):
    engine.reply = TOOL_REPLY
    async with async_client(gateway) as client:
        reply = await client.chat.completions.create(model="agent", messages=USER, tools=[WEATHER_TOOL])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    prompt = engine.tokenizer.decode(engine.calls[0][0])
    assert "<tools>" in prompt and '"get_weather"' in prompt  # the tools were rendered into the prompt
    assert gateway.records.for_rollout(None)[0].finish_reason == "tool_calls"


async def test_tool_call_streaming_deltas_reassemble(gateway: Gateway, engine: FakeEngine):
    engine.reply = "Let me check. " + TOOL_REPLY
    async with async_client(gateway) as client:
        stream = await client.chat.completions.create(model="agent", messages=USER, tools=[WEATHER_TOOL], stream=True)
        chunks = [chunk async for chunk in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    deltas = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert content == "Let me check."
    assert deltas[0].id.startswith("call_") and deltas[0].type == "function"
    assert deltas[0].function.name == "get_weather"
    assert {d.index for d in deltas} == {0}
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("reply", [TOOL_REPLY, '{"name": "get_weather", "parameters": {"city": "Paris"}}',
                                   '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'],
                         ids=["hermes", "llama3-held-to-the-end", "unclosed-block"])
async def test_streamed_tool_call_ids_are_the_recorded_ones(gateway: Gateway, engine: FakeEngine, reply: str):
    engine.reply = reply  # the last two are only known to be calls at the completion's end
    async with async_client(gateway, gateway.rollout_base_url("ids")) as client:
        stream = await client.chat.completions.create(model="agent", messages=USER, tools=[WEATHER_TOOL], stream=True)
        ids = [tc.id for chunk in [c async for c in stream] for tc in chunk.choices[0].delta.tool_calls or [] if tc.id]
    (record,) = gateway.records.for_rollout("ids")
    assert ids == [call["id"] for call in record.reply["tool_calls"]] and len(ids) == 1


async def test_assistant_tool_calls_in_history_are_rendered(gateway: Gateway, engine: FakeEngine):
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    async with async_client(gateway) as client:
        await client.chat.completions.create(model="agent", messages=history, tools=[WEATHER_TOOL])
    parsed = [*history[:1], {**history[1], "tool_calls": [{**history[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}, history[2]]
    expected = engine.tokenizer.apply_chat_template(parsed, tools=[WEATHER_TOOL], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)
    assert engine.calls[0][0] == expected
    assert "<tool_response>\n18 C\n</tool_response>" in engine.tokenizer.decode(expected)


async def test_tool_choice_none_drops_tools_and_parses_nothing(gateway: Gateway, engine: FakeEngine):
    engine.reply = TOOL_REPLY
    async with async_client(gateway) as client:
        reply = await client.chat.completions.create(
            model="agent", messages=USER, tools=[WEATHER_TOOL], tool_choice="none")
    assert "<tools>" not in engine.tokenizer.decode(engine.calls[0][0])
    assert reply.choices[0].message.content == TOOL_REPLY and reply.choices[0].message.tool_calls is None


async def test_unparsable_tool_call_is_content_and_counted(gateway: Gateway, engine: FakeEngine):
    engine.reply = "<tool_call>\n{not json}\n</tool_call>"
    async with async_client(gateway) as client:
        reply = await client.chat.completions.create(model="agent", messages=USER, tools=[WEATHER_TOOL])
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"{gateway.url}/metrics")).json()
    assert reply.choices[0].message.content == engine.reply and reply.choices[0].finish_reason == "stop"
    assert metrics["tool_call_parse_errors"] == 1


async def test_n_choices_give_n_records(gateway: Gateway, engine: FakeEngine):
    engine.reply = lambda prompt, params, i: f"Answer number {i}."
    async with async_client(gateway) as client:
        reply = await client.chat.completions.create(model="agent", messages=USER, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == ["Answer number 0.", "Answer number 1.", "Answer number 2."]
    records = gateway.records.for_rollout(None)
    assert [r.choice_index for r in records] == [0, 1, 2] and {r.request_id for r in records} == {reply.id}
    assert reply.usage.completion_tokens == sum(len(r.completion_token_ids) for r in records)


async def test_n_choices_stream(gateway: Gateway, engine: FakeEngine):
    engine.reply = lambda prompt, params, i: f"Choice {i} text."
    async with async_client(gateway) as client:
        stream = await client.chat.completions.create(model="agent", messages=USER, n=2, stream=True)
        chunks = [chunk async for chunk in stream]
    texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in (0, 1)}
    assert texts == {0: "Choice 0 text.", 1: "Choice 1 text."}


async def test_logprobs_and_top_logprobs(gateway: Gateway, engine: FakeEngine):
    engine.reply = "Hi 🙂"
    async with async_client(gateway) as client:
        reply = await client.chat.completions.create(model="agent", messages=USER, logprobs=True, top_logprobs=3)
    entries = reply.choices[0].logprobs.content
    ids = engine.tokenizer.encode("Hi 🙂", add_special_tokens=False)
    assert len(entries) == len(ids)  # the end-of-turn token is not part of the text
    assert [e.logprob for e in entries] == pytest.approx([-0.5 - 0.01 * k for k in range(len(ids))])
    assert b"".join(bytes(e.bytes) for e in entries).decode() == "Hi 🙂"  # bytes are exact, even split emoji
    for e in entries:
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    assert engine.calls[0][1].top_logprobs == 3


async def test_logprobs_stream_add_up(gateway: Gateway, engine: FakeEngine):
    engine.reply = "Several tokens in this reply."
    async with async_client(gateway) as client:
        stream = await client.chat.completions.create(model="agent", messages=USER, logprobs=True, stream=True)
        entries = [e async for c in stream if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content or []]
    assert "".join(e.token for e in entries) == engine.reply
    assert len(entries) == len(engine.tokenizer.encode(engine.reply, add_special_tokens=False))


async def test_length_finish_and_stop_string_cut(gateway: Gateway, engine: FakeEngine):
    engine.reply = "one two three four five six seven"
    async with async_client(gateway) as client:
        short = await client.chat.completions.create(model="agent", messages=USER, max_tokens=3)
        cut = await client.chat.completions.create(model="agent", messages=USER, stop="four")
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    assert cut.choices[0].message.content == "one two three " and cut.choices[0].finish_reason == "stop"


async def test_response_format_json_schema_reaches_the_engine(gateway: Gateway, engine: FakeEngine):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    engine.reply = '{"answer": 4}'
    async with async_client(gateway) as client:
        await client.chat.completions.create(model="agent", messages=USER, response_format={
            "type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
        await client.chat.completions.create(model="agent", messages=USER, response_format={"type": "json_object"})
        await client.chat.completions.create(model="agent", messages=USER, response_format={"type": "text"})
    assert [params.json_schema for _, params in engine.calls] == [schema, {"type": "object"}, None]


async def test_unknown_fields_are_ignored(gateway: Gateway):
    async with async_client(gateway) as client:
        reply = await client.chat.completions.create(
            model="agent", messages=USER, user="u1", metadata={"a": "b"}, store=False,
            extra_body={"some_vendor_field": 1, "parallel_tool_calls": True})
    assert reply.choices[0].message.content


async def test_models_list_and_names(gateway: Gateway, engine: FakeEngine):
    async with async_client(gateway) as client:
        models = [m.id for m in (await client.models.list()).data]
        assert models == ["smollm2-135m-instruct", "agent", "agent@0"]
        for name in models:  # every listed name is served at step 0
            assert (await client.chat.completions.create(model=name, messages=USER)).model == name
        engine.step = 3
        assert [m.id for m in (await client.models.list()).data][-1] == "agent@3"
        await client.chat.completions.create(model="agent@3", messages=USER)
        with pytest.raises(openai.NotFoundError, match="agent@3"):
            await client.chat.completions.create(model="agent@2", messages=USER)
        with pytest.raises(openai.NotFoundError, match="one adapter at a time"):
            await client.chat.completions.create(model="smollm2-135m-instruct", messages=USER)
        with pytest.raises(openai.BadRequestError, match="path separator"):
            await client.chat.completions.create(model="../etc/passwd", messages=USER)
        assert (await client.models.retrieve("agent@3")).id == "agent@3"


@pytest.mark.parametrize("case", ["text", "tool_call", "logprobs"])
async def test_completion_json_is_the_chat_completion_model(gateway: Gateway, engine: FakeEngine, case: str):
    # The answer is built as plain dicts for speed: it must stay exactly ChatCompletion's fields, in its order.
    from art_core.gateway.schemas import ChatCompletion

    body: dict = {"model": "agent", "messages": USER}
    if case == "tool_call":
        engine.reply, body["tools"] = TOOL_REPLY, [WEATHER_TOOL]
    if case == "logprobs":
        engine.reply, body["logprobs"], body["top_logprobs"] = "Hi 🙂", True, 2
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{gateway.base_url}/chat/completions", json=body)
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    got = response.json()
    assert got == ChatCompletion.model_validate(got).model_dump(mode="json")  # no field missing, none extra
    assert list(got) == list(ChatCompletion.model_fields)
    assert list(got["choices"][0]) == ["index", "message", "finish_reason", "logprobs"]
    assert list(got["choices"][0]["message"]) == ["role", "content", "tool_calls", "refusal"]
    assert (got["choices"][0]["logprobs"] is None) == (case != "logprobs")
    assert (got["choices"][0]["message"]["tool_calls"] is None) == (case != "tool_call")


async def test_a_json_answer_beside_tools_streams_live(gateway: Gateway, engine: FakeEngine):
    """With tools and a response_format the grammar allows Hermes calls or the JSON answer only, so a reply
    opening with "{" is the answer and streams token by token (held whole, it could be a bare llama3 call)."""
    engine.reply = '{"answer": "Paris is the capital of France"}'
    async with async_client(gateway) as client:
        stream = await client.chat.completions.create(model="agent", messages=USER, tools=[WEATHER_TOOL], stream=True,
                                                      response_format={"type": "json_object"})
        chunks = [chunk async for chunk in stream]
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(content) == engine.reply and len(content) > 5
    assert engine.calls[0][1].grammar is not None
