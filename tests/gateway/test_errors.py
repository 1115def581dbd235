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
