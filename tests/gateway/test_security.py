"""The API key, when set, guards every route; compared in constant time."""

from __future__ import annotations

import httpx
import openai
import pytest
from fakes import FakeEngine

from art_core.gateway import Gateway, GatewaySettings

ROUTES = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/rollouts/r1/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/agent"),
    ("GET", "/rollouts/r1/v1/models"),
    ("GET", "/rollouts/r1/records"),
    ("GET", "/metrics"),
    ("GET", "/health"),
    ("GET", "/no/such/route"),
]


async def test_every_route_needs_the_key(engine: FakeEngine):
    body = {"model": "agent", "messages": [{"role": "user", "content": "hi"}]}
    async with Gateway(engine, GatewaySettings(api_key="s3cret")) as gateway:
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            for method, path in ROUTES:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                    json = body if method == "POST" else None
                    response = await http.request(method, path, json=json, headers=headers)
                    assert response.status_code == 401, (method, path, headers)
                    assert response.json()["error"]["code"] == "invalid_api_key"
                    assert response.headers["www-authenticate"] == "Bearer"
            good = {"Authorization": "Bearer s3cret"}
            for method, path in ROUTES[:-1]:
                response = await http.request(method, path, json=body if method == "POST" else None, headers=good)
                assert response.status_code == 200, (method, path, response.text)
    assert engine.calls and len(engine.calls) == 2  # no unauthenticated request reached the engine


async def test_openai_client_with_and_without_key(engine: FakeEngine):
    async with Gateway(engine, GatewaySettings(api_key="s3cret")) as gateway:
        async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="s3cret", max_retries=0) as client:
            assert (await client.models.list()).data
        async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="nope", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError, match="not valid"):
                await client.models.list()
