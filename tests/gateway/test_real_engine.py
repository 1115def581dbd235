"""The gateway in front of the real TransformersEngine (tiny random Qwen2; one call to SmolLM2-135M)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from art_core.engines.transformers import TransformersEngine
from art_core.gateway import Gateway

USER = [{"role": "user", "content": "What is the capital of France?"}]


async def test_records_match_what_the_client_got(tiny_gateway: Gateway):
    tokenizer = tiny_gateway.engine.tokenizer
    async with openai.AsyncOpenAI(base_url=tiny_gateway.rollout_base_url("real"), api_key="k", max_retries=0) as client:
        reply = await client.chat.completions.create(model="agent", messages=USER, max_tokens=8, n=2, seed=1,
                                                     logprobs=True, top_logprobs=2)
    records = tiny_gateway.records.for_rollout("real")
    assert len(records) == 2 and reply.usage.completion_tokens == sum(len(r.completion_token_ids) for r in records)
    expected_prompt = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=True, return_dict=False)
    for choice, record in zip(reply.choices, records, strict=True):
        assert record.prompt_token_ids == expected_prompt
        assert len(record.logprobs) == len(record.completion_token_ids) <= 8
        assert all(lp <= 0 for lp in record.logprobs)
        assert tokenizer.decode(record.completion_token_ids, skip_special_tokens=True) == choice.message.content
        assert choice.finish_reason == record.finish_reason
        visible = [i for i in record.completion_token_ids if i not in tokenizer.all_special_ids]
        assert [e.logprob for e in choice.logprobs.content] == pytest.approx(
            [lp for i, lp in zip(record.completion_token_ids, record.logprobs) if i in visible])
        assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
        record.to_call_record()  # valid for training


async def test_concurrent_streams(tiny_gateway: Gateway):
    async with openai.AsyncOpenAI(base_url=tiny_gateway.base_url, api_key="k", max_retries=0) as client:

        async def one(k: int) -> str:
            stream = await client.chat.completions.create(
                model="agent", messages=[{"role": "user", "content": f"Count to {k}."}], max_tokens=6, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream])

        texts = await asyncio.gather(*(one(k) for k in range(4)))
    records = tiny_gateway.records.for_rollout(None)
    assert len(records) == 4
    tokenizer = tiny_gateway.engine.tokenizer
    decoded = sorted(tokenizer.decode(r.completion_token_ids, skip_special_tokens=True) for r in records)
    assert decoded == sorted(texts)


async def test_smollm2_answers(smollm2_dir: Path):
    engine = await TransformersEngine.from_pretrained(smollm2_dir, device="cpu")
    try:
        async with Gateway(engine) as gateway:
            async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="k", max_retries=0) as client:
                reply = await client.chat.completions.create(model="agent", messages=USER, max_tokens=12, temperature=0)
            (record,) = gateway.records.for_rollout(None)
    finally:
        await engine.aclose()
    assert "Paris" in reply.choices[0].message.content
    text = engine.tokenizer.decode(record.completion_token_ids, skip_special_tokens=True)
    assert text == reply.choices[0].message.content


@pytest.mark.parametrize("which", ["smollm2_dir", "tiny_model_dir"])
def test_prompt_ids_are_what_transformers_encodes(which: str, request: pytest.FixtureRequest):
    """The gateway encodes prompts through the Rust tokenizer directly; it must give transformers' ids."""
    from transformers import AutoTokenizer

    from art_core.gateway.tokens import encode_text, render_prompt

    tokenizer = AutoTokenizer.from_pretrained(request.getfixturevalue(which))
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]
    messages = [{"role": "system", "content": "Be brief.\n\n  Indented, tabs\tand ünïcödé 🙂."},
                {"role": "user", "content": "What is 2+3? <tool_call> is a tag.\n\n\n"}]
    expected = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    assert render_prompt(tokenizer, messages, tools) == list(expected)
    for text in ("", " leading space", "<|im_end|>special", "a\n\nb", "x" * 500):
        assert encode_text(tokenizer, text) == tokenizer.encode(text, add_special_tokens=False)


async def test_load_on_the_continuously_batched_engine(tiny_gateway: Gateway):
    """200+ requests from 32 sessions on the real engine: rows join and leave the running batch all the time.

    Every request is answered, each choice has exactly one record under its own rollout, and greedy
    choices are token for token what the same prompt gives decoded alone (joining a batch, the padding
    it needs and rows leaving around it change nothing).
    """
    engine = tiny_gateway.engine
    sessions, per_session = 32, 7  # 224 requests
    answered: dict[str, list[str]] = {}

    async def session(k: int) -> None:
        rollout = f"load-{k}"
        async with openai.AsyncOpenAI(base_url=tiny_gateway.rollout_base_url(rollout), api_key="k",
                                      max_retries=0) as client:
            for j in range(per_session):
                n = 2 if j % 3 == 0 else 1
                reply = await client.chat.completions.create(
                    model="agent", messages=[{"role": "user", "content": f"{rollout} question {j} " + "x" * (k % 5)}],
                    max_tokens=1 + (k + j) % 12, n=n, temperature=0 if j % 2 else 1.0, seed=k * 100 + j)
                answered.setdefault(rollout, []).extend(c.message.content or "" for c in reply.choices)

    await asyncio.gather(*(session(k) for k in range(sessions)))
    assert engine.stats["max_rows"] > 8  # the load did batch (a batch per request would give 1 or 2)
    tokenizer = engine.tokenizer
    greedy_checked = 0
    for k in range(sessions):
        rollout = f"load-{k}"
        records = tiny_gateway.records.for_rollout(rollout)
        assert len(records) == len(answered[rollout])
        assert all(r.request["messages"][0]["content"].startswith(f"{rollout} ") for r in records)
        assert [tokenizer.decode(r.completion_token_ids, skip_special_tokens=True) for r in records] == answered[rollout]
        for record in records:
            if record.request.get("temperature") == 0 and greedy_checked < 24:
                from art_core.engines.base import SamplingParams

                (alone,) = engine.generate_batch([record.prompt_token_ids], [SamplingParams(
                    max_tokens=record.request["max_tokens"], temperature=0)])[0]
                assert alone.token_ids == record.completion_token_ids
                greedy_checked += 1
    assert greedy_checked == 24


async def test_the_seed_header_seeds_a_call_that_names_no_seed(tiny_gateway: Gateway):
    """``X-Art-Seed`` (what a seeded rollout's adapter sends) samples as the body's ``seed`` does, on both APIs;
    a body's own seed wins; a malformed header is a 400 that names it."""
    url = tiny_gateway.rollout_base_url("seeded")
    async with openai.AsyncOpenAI(base_url=url, api_key="k", max_retries=0) as client:
        async def chat(**kwargs) -> list[int]:
            reply = await client.chat.completions.with_raw_response.create(
                model="agent", messages=USER, max_tokens=12, temperature=1.0, **kwargs)
            return next(r for r in tiny_gateway.records.for_rollout("seeded")
                        if r.request_id == reply.headers["X-Request-Id"]).completion_token_ids

        by_body, by_header = await chat(seed=42), await chat(extra_headers={"X-Art-Seed": "42"})
        assert by_body == by_header and len(by_body) == 12
        assert await chat(extra_headers={"X-Art-Seed": "43"}) != by_body  # 12 tokens of a random model at T=1
        assert await chat(seed=42, extra_headers={"X-Art-Seed": "43"}) == by_body  # the body's seed wins

        async def responses(seed: str) -> str:
            reply = await client.responses.create(model="agent", input="Hi!", max_output_tokens=12,
                                                  extra_headers={"X-Art-Seed": seed})
            return reply.output_text

        assert await responses("7") == await responses("7") != await responses("8")
        for bad in ("-1", "1.5", "x", str(2**63)):
            with pytest.raises(openai.BadRequestError, match="X-Art-Seed") as caught:
                await chat(extra_headers={"X-Art-Seed": bad})
            assert caught.value.code == "invalid_seed"
