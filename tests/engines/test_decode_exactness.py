"""The engine's batched decode path (pre-allocated KV buffers, rows joining and leaving, prompts deduplicated
and taken from the prefix cache) against a plain one-row forward pass, token for token."""

from __future__ import annotations

import asyncio

import pytest
import torch

from art_core.engines.base import SamplingParams
from art_core.engines.transformers import TransformersEngine

PROMPTS = [[1, 9707, 11, 1122, 359, 346, 47], [1, 504, 2114, 281, 253, 2], [1, 3702, 30, 2, 198, 1],
           [1, 9707, 11, 1122, 359, 346, 47, 504, 2114, 281, 253, 2, 3702, 30]]


@pytest.fixture
async def engine(tiny_model_dir):
    engine = await TransformersEngine.from_pretrained(tiny_model_dir, device="cpu")
    engine.stop_ids = {-1}  # every row runs to its max_tokens, so rows leave exactly when planned
    yield engine
    await engine.aclose()


def _plain_greedy(model, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
    """Greedy decoding with one row and no cache: the whole sequence through the model at every step."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(tokens):
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
            token = int(logp.argmax())
            ids.append(token)
            logprobs.append(float(logp[token]))
    return ids[len(prompt):], logprobs


async def _wait_for_steps(engine: TransformersEngine, steps: int) -> None:
    target = engine.stats["steps"] + steps
    while engine.stats["steps"] < target:
        await asyncio.sleep(0.001)


async def test_rows_joining_and_leaving_decode_what_one_row_alone_decodes(engine):
    def greedy(tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=tokens, temperature=0)

    long = asyncio.create_task(engine.generate(PROMPTS[0], greedy(90)))  # outlives everything below
    await _wait_for_steps(engine, 3)
    first = await asyncio.gather(engine.generate(PROMPTS[1], greedy(5)),  # joins, leaves early (columns trimmed)
                                 engine.generate(PROMPTS[3], greedy(70)),  # joins, longer than the running row
                                 engine.generate(PROMPTS[2], greedy(20)))
    # Rows joining a batch whose buffers were already re-allocated and trimmed; PROMPTS[1] twice in one
    # admission (prefilled once) and once more from the prefix cache (not prefilled at all).
    second = await asyncio.gather(engine.generate(PROMPTS[1], greedy(80)), engine.generate(PROMPTS[1], greedy(80)),
                                  engine.generate(PROMPTS[2], greedy(3)))
    outputs = [await long, *first, *second]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[2], PROMPTS[1], PROMPTS[1], PROMPTS[2]]
    assert engine.stats["max_rows"] >= 4 and engine.stats["batches"] >= 3
    assert engine.stats["prefills"] < len(prompts)  # repeated prompts were not run through the model again
    worst = 0.0
    for prompt, (out,) in zip(prompts, outputs):
        tokens, logprobs = _plain_greedy(engine.model, prompt, len(out.token_ids))
        assert out.token_ids == tokens
        worst = max(worst, max(abs(a - b) for a, b in zip(out.logprobs, logprobs)))
    print(f"batched decode vs one-row forward: max |logprob gap| = {worst:.2e}")
    assert worst < 1e-5


async def test_a_prompt_from_the_prefix_cache_samples_what_a_fresh_prefill_samples(engine):
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=7)
    (fresh,) = await engine.generate(PROMPTS[3], params)
    prefills = engine.stats["prefills"]
    (cached,) = await engine.generate(PROMPTS[3], params)
    assert engine.stats["prefills"] == prefills  # taken from the cache
    assert cached.token_ids == fresh.token_ids and cached.logprobs == fresh.logprobs
    await engine.pause()  # the weights may change while paused: the cache is dropped
    await engine.resume()
    await engine.generate(PROMPTS[3], params)
    assert engine.stats["prefills"] == prefills + 1


async def test_the_prefix_cache_can_be_turned_off(tiny_model_dir):
    engine = await TransformersEngine.from_pretrained(tiny_model_dir, device="cpu", prefix_cache_mb=0)
    try:
        params = SamplingParams(max_tokens=2, temperature=0)
        await engine.generate(PROMPTS[0], params)
        await engine.generate(PROMPTS[0], params)
        assert engine.stats["prefills"] == 2
    finally:
        await engine.aclose()
