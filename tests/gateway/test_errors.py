"""Client mistakes get a 4xx in OpenAI's error shape (never a 500); engine failures a 500/503, same shape."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fakes import WEATHER_TOOL, FakeEngine

from art_core.errors import LifecycleError
from art_core.gateway import Gateway, GatewaySettings

USER = [{"role": "user", "content": "Hi!"}]


def assert_openai_error(response: httpx.Response, status: int, *, param: str | None = None, says: str = "") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if param is not None:
        assert error["param"] == param
    assert says in error["message"], error["message"]
    return error


async def post(gateway: Gateway, body: object, *, path: str = "/v1/chat/completions", **kwargs) -> httpx.Response:
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        if isinstance(body, (bytes, str)):
            return await http.post(path, content=body, headers={"content-type": "application/json"}, **kwargs)
        return await http.post(path, json=body, **kwargs)


async def test_malformed_json(gateway: Gateway):
    error = assert_openai_error(await post(gateway, b'{"model": "agent", "messages": ['), 400, says="not valid JSON")
    assert error["code"] == "invalid_json"
    assert_openai_error(await post(gateway, b'["a list"]'), 400, says="JSON object")


async def test_validation_errors_name_the_field(gateway: Gateway):
    bad_role = {"model": "agent", "messages": [{"role": "robot", "content": "hi"}]}
    assert_openai_error(await post(gateway, bad_role), 400, param="messages[0].role", says="messages[0].role")
    missing = {"messages": USER}
    assert_openai_error(await post(gateway, missing), 400, param="model", says="Field required")
    assert_openai_error(await post(gateway, {"model": "agent", "messages": USER, "temperature": 7}), 400,
                        param="temperature")
    assert_openai_error(await post(gateway, {"model": "agent", "messages": USER, "top_logprobs": 2}), 400,
                        says="top_logprobs needs logprobs=true")
    assert_openai_error(await post(gateway, {"model": "agent", "messages": []}), 400, param="messages")


async def test_unknown_model(gateway: Gateway):
    error = assert_openai_error(await post(gateway, {"model": "gpt-4o", "messages": USER}), 404, param="model",
                                says="agent@0")
    assert error["code"] == "model_not_found"


async def test_max_tokens_over_the_limit(gateway: Gateway, engine: FakeEngine):
    for field in ("max_tokens", "max_completion_tokens"):
        assert_openai_error(await post(gateway, {"model": "agent", "messages": USER, field: 4097}), 400, param=field,
                            says="limit of 4096")
    assert engine.calls == []


@pytest.mark.parametrize(
    ("parameters", "says"),
    [
        ({"type": "string"}, "\"type\": \"object\""),
        ({"type": "object", "properties": {"city": {"type": "strin"}}}, "not a valid JSON Schema"),
        ({"type": "object", "required": "city"}, "not a valid JSON Schema"),
    ],
)
async def test_invalid_tool_schema(gateway: Gateway, parameters: dict, says: str):
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    assert_openai_error(await post(gateway, {"model": "agent", "messages": USER, "tools": [tool]}), 400,
                        param="tools[0].function.parameters", says=says)


async def test_tool_definitions_are_checked(gateway: Gateway):
    no_params = {"type": "function", "function": {"name": "now"}}
    ok = await post(gateway, {"model": "agent", "messages": USER, "tools": [no_params]})
    assert ok.status_code == 200  # a function without parameters is fine
    twice = {"model": "agent", "messages": USER, "tools": [WEATHER_TOOL, WEATHER_TOOL]}
    assert_openai_error(await post(gateway, twice), 400, says="unique")
    named = {"model": "agent", "messages": USER, "tools": [WEATHER_TOOL],
             "tool_choice": {"type": "function", "function": {"name": "other"}}}
    assert_openai_error(await post(gateway, named), 400, says="'other'")
    bad_name = {"type": "function", "function": {"name": "has space"}}
    assert_openai_error(await post(gateway, {"model": "agent", "messages": USER, "tools": [bad_name]}), 400,
                        param="tools[0].function.name")


async def test_oversized_body(engine: FakeEngine):
    settings = GatewaySettings(max_request_bytes=10_000)
    async with Gateway(engine, settings) as gateway:
        big = {"model": "agent", "messages": [{"role": "user", "content": "x" * 20_000}]}
        assert_openai_error(await post(gateway, big), 413, says="limit of 10000")

        async def chunks():  # no Content-Length: counted while reading
            for _ in range(20):
                yield b" " * 1000

        async with httpx.AsyncClient(base_url=gateway.url) as http:
            streamed = await http.post("/v1/chat/completions", content=chunks())
        assert_openai_error(streamed, 413, says="more than 10000")
        ok = await post(gateway, {"model": "agent", "messages": USER})
        assert ok.status_code == 200  # the server still serves
    assert engine.calls and len(engine.calls) == 1


async def test_template_refusal_is_422(gateway: Gateway):
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
    assert_openai_error(await post(gateway, {"model": "agent", "messages": [image]}), 422, param="messages",
                        says="image_url")


async def test_unknown_route_and_method(gateway: Gateway):
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        assert_openai_error(await http.get("/v2/nothing"), 404, says="no route GET /v2/nothing")
        assert_openai_error(await http.get("/v1/chat/completions"), 405)


async def test_invalid_rollout_id(gateway: Gateway):
    body = {"model": "agent", "messages": USER}
    assert_openai_error(await post(gateway, body, path="/rollouts/bad%20id/v1/chat/completions"), 400,
                        param="rollout_id")
    assert_openai_error(await post(gateway, body, headers={"X-Rollout-Id": "x" * 129}), 400, param="rollout_id")
    assert_openai_error(await post(gateway, body, path="/rollouts/a/v1/chat/completions",
                                   headers={"X-Rollout-Id": "b"}), 400, says="'a'")


async def test_engine_failure_is_500_and_the_server_goes_on(gateway: Gateway, engine: FakeEngine):
    engine.fail_with = RuntimeError("CUDA out of memory")
    response = await post(gateway, {"model": "agent", "messages": USER})
    error = assert_openai_error(response, 500, says="CUDA out of memory")
    assert error["code"] == "engine_error"
    engine.fail_with = LifecycleError("engine closed")
    assert_openai_error(await post(gateway, {"model": "agent", "messages": USER}), 503, says="engine closed")
    engine.fail_with = None
    assert (await post(gateway, {"model": "agent", "messages": USER})).status_code == 200
    assert gateway.records.for_rollout(None)[0].choice_index == 0 and len(gateway.records) == 1


async def test_errors_are_counted(gateway: Gateway):
    await post(gateway, b"{")
    await post(gateway, {"model": "nope", "messages": USER})
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        metrics = (await http.get("/metrics")).json()
    assert metrics["errors"] == {"400": 1, "404": 1} and metrics["requests"] == 3


async def test_openai_client_raises_typed_errors(gateway: Gateway):
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as info:
            await client.chat.completions.create(model="nope", messages=USER)
        assert info.value.code == "model_not_found" and info.value.param == "model"
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="agent", messages=USER, max_tokens=10**6)


async def test_client_dropping_a_stream(gateway: Gateway, engine: FakeEngine):
    engine.reply = "word " * 3000  # ~3000 chunks, ~600 kB: more than the socket buffers hold
    body = {"model": "agent", "messages": USER, "stream": True, "max_tokens": 4000}
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    json.loads(line[6:])
                    break  # leave mid-stream: the connection is closed
        ok = await http.post("/v1/chat/completions", json={"model": "agent", "messages": USER})
    assert ok.status_code == 200
    assert len(gateway.records.for_rollout(None)) == 2  # the dropped stream was recorded: generation had finished


async def test_a_lone_surrogate_is_a_400_naming_where_it_is(gateway: Gateway, engine: FakeEngine):
    """Valid JSON can carry half of an escaped character pair (text cut in the middle of an emoji): no tokenizer,
    record or response can encode it, so it is refused up front, streamed or not."""
    cut = '{"model": "agent", "messages": [{"role": "user", "content": "Hi \\ud83d"}]}'
    assert_openai_error(await post(gateway, cut), 400, param="messages[0].content", says="lone UTF-16 surrogate")
    in_stop = '{"model": "agent", "messages": [{"role": "user", "content": "Hi"}], "stop": ["\\udc80"], "stream": true}'
    assert_openai_error(await post(gateway, in_stop), 400, param="stop[0]", says="lone UTF-16 surrogate")
    assert engine.calls == []
    whole = '{"model": "agent", "messages": [{"role": "user", "content": "Hi \\ud83d\\ude00"}], "max_tokens": 4}'
    response = await post(gateway, whole)  # a pair, escaped as json.dumps writes it, is one character
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("field", "value"), [("presence_penalty", 0.5), ("frequency_penalty", -1.0),
                                              ("logit_bias", {"504": -100}), ("functions", [{"name": "f"}]),
                                              ("function_call", "auto")])
async def test_options_that_would_sample_another_distribution_are_refused(gateway: Gateway, engine: FakeEngine,
                                                                          field: str, value: object):
    """The trainer weighs tokens by the sampler's log-probs: a penalised or biased sampler is another policy."""
    assert_openai_error(await post(gateway, {"model": "agent", "messages": USER, field: value}), 400, param=field)
    assert engine.calls == []


async def test_neutral_values_of_those_options_are_accepted(gateway: Gateway):
    body = {"model": "agent", "messages": USER, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
            "max_tokens": 4}
    assert (await post(gateway, body)).status_code == 200


async def test_a_completion_that_would_run_past_the_context(gateway: Gateway, engine: FakeEngine,
                                                            monkeypatch: pytest.MonkeyPatch):
    """A length the request set that does not fit is refused (as OpenAI and vLLM do); the default is shortened."""
    monkeypatch.setattr(engine.tokenizer, "model_max_length", 200)
    for field in ("max_tokens", "max_completion_tokens"):
        error = assert_openai_error(await post(gateway, {"model": "agent", "messages": USER, field: 190}), 400,
                                    param=field, says="but the model's context is 200")
        assert error["code"] == "context_length_exceeded" and f"set {field} to at most" in error["message"]
    assert engine.calls == []
    assert (await post(gateway, {"model": "agent", "messages": USER})).status_code == 200
    ((prompt, params),) = engine.calls
    assert params.max_tokens == 200 - len(prompt)  # the default (1024) cut to what is left of the context
    responses = await post(gateway, {"model": "agent", "input": "Hi!", "max_output_tokens": 190}, path="/v1/responses")
    assert_openai_error(responses, 400, param="max_output_tokens", says="set max_output_tokens to at most")


async def test_a_stream_with_usage_has_a_null_usage_on_every_other_chunk(gateway: Gateway):
    body = {"model": "agent", "messages": USER, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        response = await http.post("/v1/chat/completions", json=body)
    chunks = [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines()
              if line.startswith("data: {")]
    assert all("usage" in c for c in chunks)  # OpenAI: the key is there, null, until the last chunk
    assert [c["usage"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
