"""RULER end to end with a real judge: the embedded SmolLM2 behind our gateway, JSON constrained by llguidance.

litellm calls the gateway as any OpenAI-compatible server (``openai/<served name>`` with ``api_base``), the
gateway turns ``response_format`` into ``SamplingParams.json_schema``, and the transformers engine masks
every step, so even a 135M model returns an answer that parses and fits the schema on the first try.
SmolLM2 is no good judge; what is checked is the plumbing: one score per run, all in range, scores mapped
back to the right run through the shuffles, and a re-run answered from the cache without a request.
"""

from __future__ import annotations

import json
import re

import pytest
from fake_judges import capital_group

from art_core import JudgeUsage, ruler_score_group
from art_core.rewards._prompt import SCORE_GRID
from art_core.gateway import Gateway, GatewaySettings


@pytest.fixture
async def judge_gateway(smollm2_dir, tmp_path):
    from art_core.engines.transformers import TransformersEngine

    engine = await TransformersEngine.from_pretrained(smollm2_dir, device="cpu")
    try:
        async with Gateway(engine, GatewaySettings(model_name="smollm2-judge",
                                                   records_path=tmp_path / "records.jsonl")) as gateway:
            yield gateway
    finally:
        await engine.aclose()


async def test_ruler_with_the_embedded_model_as_judge(judge_gateway, tmp_path):
    group = capital_group()
    settings = {
        "judge": "openai/smollm2-judge", "api_base": judge_gateway.base_url, "api_key": "local",
        "orders": 2, "seed": 1, "cache_dir": tmp_path / "ruler-cache",
        "explanation_max_chars": 60,  # keeps the 135M model's answer short: ~80 tokens for 3 runs
        "completion_kwargs": {"temperature": 0, "max_tokens": 300},
    }
    usage = JudgeUsage()
    scored = await ruler_score_group(group, **settings, usage=usage)

    # one score per trajectory, all in range, nothing repaired: constrained decoding got it right first time
    assert len(scored) == 3 and all(0.0 <= t.reward <= 1.0 for t in scored)
    assert [t.metrics["reward_before_ruler"] for t in scored] == group.rewards == [0.5, 1.5, 2.5]
    assert (usage.calls, usage.repairs, usage.cache_hits) == (2, 0, 0)
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0

    # each run's score is what the judge said about the block holding that run's text, in both orders
    records = judge_gateway.records.for_rollout(None)
    assert len(records) == 2
    for trajectory in scored:
        answer_text = trajectory.messages[-1].text()
        per_order = []
        for record in records:
            prompt = next(m["content"] for m in record.request["messages"] if m["role"] == "user")
            blocks = dict(re.findall(r'<trajectory id="(trajectory_\d+)">\n(.*?)\n</trajectory>', prompt, re.S))
            label = next(label for label, block in blocks.items() if answer_text in block)
            verdict = json.loads(judge_gateway.engine.tokenizer.decode(record.completion_token_ids,
                                                                       skip_special_tokens=True))[label]
            assert verdict["score"] in SCORE_GRID  # the grid held the constrained decoder to hundredths
            assert f"shown as {label}): score {verdict['score']:.3f}" in "\n".join(trajectory.logs)
            per_order.append(verdict["score"])
        assert trajectory.reward == pytest.approx(sum(per_order) / 2)

    # a re-run is answered from the cache: no request reaches the gateway
    requests_before = judge_gateway.metrics.requests
    again = await ruler_score_group(group, **settings, usage=usage)
    assert judge_gateway.metrics.requests == requests_before and len(judge_gateway.records.for_rollout(None)) == 2
    assert again.rewards == scored.rewards and usage.cache_hits == 2
