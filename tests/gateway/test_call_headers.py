"""Every completion names its record, the adapter step that served it and its token counts in headers."""

from __future__ import annotations

import httpx
import pytest

from art_core.gateway import Gateway

from fakes import FakeEngine

USER = [{"role": "user", "content": "Hi!"}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["chat/completions", "responses"])
async def test_headers_describe_the_recorded_call(gateway: Gateway, engine: FakeEngine, endpoint: str, stream: bool):
    body = ({"model": "agent", "messages": USER, "n": 2} if endpoint == "chat/completions"
            else {"model": "agent", "input": "Hi!"}) | {"stream": stream}
    engine.step = 3  # as if checkpoint 3 were served
    async with httpx.AsyncClient(base_url=gateway.base_url) as client:
        response = await client.post(f"/{endpoint}", json=body, headers={"X-Rollout-Id": "r-headers"})
    assert response.status_code == 200, response.text
    records = gateway.records.for_rollout("r-headers")
    assert {r.request_id for r in records} == {response.headers["X-Request-Id"]}
    assert response.headers["X-Art-Adapter-Step"] == "3" == str(records[0].adapter_step)
    assert int(response.headers["X-Art-Prompt-Tokens"]) == len(records[0].prompt_token_ids)
    if stream:  # a live stream's headers leave before its tokens are sampled: the count is in the record only
        assert "X-Art-Completion-Tokens" not in response.headers
    else:
        assert int(response.headers["X-Art-Completion-Tokens"]) == sum(len(r.completion_token_ids) for r in records)
