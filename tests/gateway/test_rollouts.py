"""Records are scoped per rollout (URL prefix or X-Rollout-Id), persisted one line per choice, under load too."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from fakes import FakeEngine, random_delay

from art_core import LoraSettings, ModelSpec
from art_core.backends.ray.rollouts import GatewayView
from art_core.errors import ConfigError
from art_core.gateway import ExchangeRecord, Gateway, GatewaySettings
from art_core.wire import RolloutStatus


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


async def _until(condition: Callable[[], bool]) -> None:
    """Wait until ``condition()`` holds: an event the test has no handle to await (no guess at how long it takes)."""
    while not condition():
        await asyncio.sleep(0.01)


async def test_status_counts_the_calls_received_and_not_yet_answered(tiny_gateway: Gateway):
    gateway = tiny_gateway
    await gateway.engine.pause()  # the test holds the engine: it queues what it gets and answers nothing
    async with openai.AsyncOpenAI(base_url=gateway.rollout_base_url("held"), api_key="k", max_retries=0) as client, \
            httpx.AsyncClient(base_url=gateway.url) as http:
        plain = asyncio.create_task(client.chat.completions.create(model="agent", messages=user("a"), max_tokens=3))
        streamed = asyncio.create_task(client.chat.completions.create(model="agent", messages=user("b"), max_tokens=3,
                                                                      stream=True))
        await _until(lambda: gateway.rollout_status("held").unanswered == 2)
        assert (await http.get("/rollouts/held/status")).json() == {"unanswered": 2, "gateway": "serving"}
        assert (await http.get("/rollouts/other/status")).json() == {"unanswered": 0, "gateway": "serving"}
        assert (await http.get("/rollouts/a%20b/status")).status_code == 400
        assert gateway.records.for_rollout("held") == [] and not plain.done() and not streamed.done()
        await gateway.engine.resume()
        await plain
        async for _ in await streamed:
            pass
        assert (await http.get("/rollouts/held/status")).json() == {"unanswered": 0, "gateway": "serving"}
    assert len(gateway.records.for_rollout("held")) == 2


async def test_status_names_a_paused_gateway(gateway: Gateway):
    async with openai.AsyncOpenAI(base_url=gateway.rollout_base_url("held"), api_key="k", max_retries=0) as client:
        await gateway.pause_for_training()
        held = asyncio.create_task(client.chat.completions.create(model="agent", messages=user("a")))
        await _until(lambda: gateway.rollout_status("held").unanswered == 1)
        assert gateway.rollout_status("held").gateway == "paused" and not held.done()
        # What a Ray rollout worker sees over HTTP (its GatewayView is async: the loop serving this gateway runs on).
        view = GatewayView(gateway.url, None, 0)
        spec = ModelSpec(name="agent", project="p", base_model="x", lora=LoraSettings())
        status = await view.rollout_status(spec, "held")
        assert status == RolloutStatus(unanswered=1, gateway="paused")
        await gateway.resume_after_training(0)
        await held
    assert gateway.rollout_status("held").model_dump() == {"unanswered": 0, "gateway": "serving"}
