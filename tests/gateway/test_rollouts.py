"""Records are scoped per rollout (URL prefix or X-Rollout-Id), persisted one line per choice, under load too."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest
from fakes import FakeEngine, random_delay

from art_core.errors import ConfigError
from art_core.gateway import ExchangeRecord, Gateway, GatewaySettings


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def test_records_by_path_prefix_and_header(gateway: Gateway):
    assert gateway.rollout_base_url("run-1") == f"{gateway.url}/rollouts/run-1/v1"
    async with openai.AsyncOpenAI(base_url=gateway.rollout_base_url("run-1"), api_key="k", max_retries=0) as scoped:
        await scoped.chat.completions.create(model="agent", messages=user("first"))
        await scoped.chat.completions.create(model="agent", messages=user("second"), n=2)
    headers = {"X-Rollout-Id": "run-2"}
    async with openai.AsyncOpenAI(
        base_url=gateway.base_url, api_key="k", max_retries=0, default_headers=headers
    ) as hdr:
        await hdr.chat.completions.create(model="agent", messages=user("third"))
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="k", max_retries=0) as plain:
        await plain.chat.completions.create(model="agent", messages=user("outside"))

    run1 = gateway.records.for_rollout("run-1")
    texts = [(r.request["messages"][0]["content"], r.choice_index) for r in run1]
    assert texts == [("first", 0), ("second", 0), ("second", 1)]
    assert [r.request["messages"][0]["content"] for r in gateway.records.for_rollout("run-2")] == ["third"]
    assert [r.request["messages"][0]["content"] for r in gateway.records.for_rollout(None)] == ["outside"]

    async with httpx.AsyncClient(base_url=gateway.url) as http:
        listed = (await http.get("/rollouts/run-1/records")).json()
        assert (await http.get("/rollouts/nobody/records")).json() == []
    assert [ExchangeRecord.model_validate(r) for r in listed] == run1


async def test_persistence_file_has_one_line_per_answered_choice(gateway: Gateway):
    async with openai.AsyncOpenAI(base_url=gateway.rollout_base_url("r"), api_key="k", max_retries=0) as client:
        await client.chat.completions.create(model="agent", messages=user("a"), n=3)
        stream = await client.chat.completions.create(model="agent", messages=user("b"), stream=True)
        async for _ in stream:
            pass
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="other", messages=user("refused"))
    path = gateway.settings.records_path
    assert path is not None
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    texts = [(r["request"]["messages"][0]["content"], r["choice_index"]) for r in lines]
    assert texts == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]
    assert all(r["rollout_id"] == "r" for r in lines)


def test_rollout_base_url_checks_the_id(engine: FakeEngine):
    gateway = Gateway(engine)
    for bad in ("a/b", "..", "", "x" * 129, "sp ace"):
        with pytest.raises(ConfigError, match="rollout id"):
            gateway.rollout_base_url(bad)  # checked before the port is needed


async def test_load_32_sessions_200_requests(engine: FakeEngine, tmp_path: Path):
    """Every request is answered or refused with a clear error; one record per answered choice, right rollout."""
    engine.delay = random_delay(0.0, 0.02)
    engine.reply = lambda prompt, params, i: f"reply {len(prompt)} {i}"
    settings = GatewaySettings(records_path=tmp_path / "records.jsonl")
    sessions, per_session = 32, 200 // 32 + 1  # 32 x 7 = 224 >= 200
    answered: dict[str, int] = {}  # rollout -> answered choices
    refused: list[str] = []

    async with Gateway(engine, settings) as gateway:

        async def session(k: int) -> None:
            rollout = f"session-{k}"
            by_header = k % 2 == 1  # half scope by URL, half by header
            base = gateway.base_url if by_header else gateway.rollout_base_url(rollout)
            headers = {"X-Rollout-Id": rollout} if by_header else None
            async with openai.AsyncOpenAI(base_url=base, api_key="k", max_retries=0, default_headers=headers) as client:
                for j in range(per_session):
                    n = 2 if j % 3 == 0 else 1
                    model = "agent" if (k + j) % 10 else "unknown-model"  # ~10% refused
                    try:
                        if j % 4 == 1:
                            stream = await client.chat.completions.create(
                                model=model, messages=user(f"{rollout} {j}"), n=n, stream=True)
                            async for _ in stream:
                                pass
                        else:
                            await client.chat.completions.create(model=model, messages=user(f"{rollout} {j}"), n=n)
                        answered[rollout] = answered.get(rollout, 0) + n
                    except openai.NotFoundError as exc:
                        assert "does not exist here" in str(exc)
                        refused.append(rollout)

        await asyncio.gather(*(session(k) for k in range(sessions)))
        total = sum(answered.values())
        assert total + len(refused) > 200 and refused
        for k in range(sessions):
            rollout = f"session-{k}"
            records = gateway.records.for_rollout(rollout)
            assert len(records) == answered.get(rollout, 0)
            # None under the wrong rollout: each request's text names its session.
            assert all(r.request["messages"][0]["content"].startswith(f"{rollout} ") for r in records)
            pairs = [(r.request_id, r.choice_index) for r in records]
            assert len(set(pairs)) == len(pairs)
        assert gateway.records.for_rollout(None) == []
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert len(lines) == total
