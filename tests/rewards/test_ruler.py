"""ruler_score_group through litellm against a scripted judge on loopback: repairs, errors, cache, shuffles.

The end-to-end run with a real judge (SmolLM2 behind our gateway) is in ``test_ruler_gateway.py``.
"""

from __future__ import annotations

import json
import socket
import sys

import pytest
from fake_judges import NO_CHOICES, capital_group, score_by_content, trajectory_blocks

from art_core import JudgeError, JudgeUsage, RewardError, ruler_score_group
from art_core.errors import ConfigError
from art_core.rewards import ruler_step_scores
from art_core.types import Message, Trajectory, TrajectoryGroup

ORIGINAL = [0.5, 1.5, 2.5]  # capital_group's rewards


def judge_kwargs(fake_judge, tmp_path, **more):
    return {"judge": "openai/judge", "api_base": fake_judge.base_url, "api_key": "local",
            "cache_dir": tmp_path / "cache", "completion_kwargs": {"max_retries": 0}, **more}


def by_city(group: TrajectoryGroup) -> dict[str, float]:
    city = {"run-0": "Paris", "run-1": "Lyon", "run-2": "none"}
    return {city[t.id]: t.reward for t in group}


async def test_scores_become_rewards_and_the_old_reward_is_kept(fake_judge, group, tmp_path):
    scored = await ruler_score_group(group, **judge_kwargs(fake_judge, tmp_path))
    assert by_city(scored) == {"Paris": 1.0, "Lyon": 0.3, "none": 0.0}
    for before, after in zip(group, scored, strict=True):
        assert after.metrics["reward_before_ruler"] == before.reward
        assert after.metrics["ruler_score"] == after.reward
        assert after.logs[-1].startswith("RULER (openai/judge, shown as trajectory_") and "saw" in after.logs[-1]
    assert group.rewards == ORIGINAL and not any(t.logs for t in group)  # the input is left alone
    assert scored.metadata["ruler_calls"] == 1 and scored.metadata["ruler_prompt_tokens"] == 100
    assert scored.metadata["ruler_unpriced_calls"] == 1  # litellm has no price for a local model
    request = fake_judge.requests[0]
    assert request["model"] == "judge"
    assert request["response_format"]["type"] == "json_schema"
    assert request["response_format"]["json_schema"]["schema"]["required"] == ["trajectory_1", "trajectory_2",
                                                                              "trajectory_3"]


async def test_score_follows_its_trajectory_through_every_shuffle(fake_judge, group, tmp_path):
    orders_seen = set()
    for seed in range(6):
        scored = await ruler_score_group(group, **judge_kwargs(fake_judge, tmp_path, seed=seed))
        assert by_city(scored) == {"Paris": 1.0, "Lyon": 0.3, "none": 0.0}  # judged by content, wherever it sat
        blocks = trajectory_blocks(fake_judge.requests[-1])
        orders_seen.add(tuple("Paris" in blocks[f"trajectory_{k}"] for k in (1, 2, 3)))
    assert len(orders_seen) > 1  # the seeds really did move the runs around


async def test_several_orders_are_averaged(fake_judge, group, tmp_path):
    # A judge with position bias: the first trajectory shown always gets +0.2 (capped at 1).
    def biased(body):
        answer = json.loads(score_by_content(body))
        first = answer["trajectory_1"]
        first["score"] = min(1.0, first["score"] + 0.2)
        return json.dumps(answer)

    fake_judge.default = biased
    scored = await ruler_score_group(group, **judge_kwargs(fake_judge, tmp_path, orders=3, seed=4))
    assert len(fake_judge.requests) == 3
    firsts = [trajectory_blocks(request)["trajectory_1"] for request in fake_judge.requests]
    for trajectory, base in zip(scored, [1.0, 0.3, 0.0], strict=True):
        city = {1.0: "Paris", 0.3: "Lyon", 0.0: "I do not know"}[base]
        times_first = sum(city in block for block in firsts)
        expected = (3 * base + times_first * (0.2 if base < 1.0 else 0.0)) / 3
        assert trajectory.reward == pytest.approx(expected)
        assert len([line for line in trajectory.logs if line.startswith("RULER")]) == 3
        assert "ruler_score_spread" in trajectory.metrics


async def test_a_rerun_is_answered_from_the_cache(fake_judge, group, tmp_path):
    usage = JudgeUsage()
    first = await ruler_score_group(group, **judge_kwargs(fake_judge, tmp_path, orders=2), usage=usage)
    second = await ruler_score_group(group, **judge_kwargs(fake_judge, tmp_path, orders=2), usage=usage)
    assert len(fake_judge.requests) == 2  # the re-run sent nothing
    assert second.rewards == first.rewards
    assert (usage.calls, usage.cache_hits, usage.prompt_tokens) == (2, 2, 200)
    assert second.metadata["ruler_calls"] == 0 and second.metadata["ruler_cache_hits"] == 2
    await ruler_score_group(group, **judge_kwargs(fake_judge, tmp_path, orders=2), rubric="Prefer short answers.")
    assert len(fake_judge.requests) == 4  # another rubric is another question
    await ruler_score_group(group, **judge_kwargs(fake_judge, tmp_path, orders=2, cache_dir=None))
    assert len(fake_judge.requests) == 6  # no cache, no hit
    for entry in (tmp_path / "cache").glob("*/*.json"):
        entry.write_text("{half an entry")  # e.g. a disk that filled up: a miss, then rewritten
    assert (await ruler_score_group(group, **judge_kwargs(fake_judge, tmp_path, orders=2))).rewards == first.rewards
    assert len(fake_judge.requests) == 8
    await ruler_score_group(group, **judge_kwargs(fake_judge, tmp_path, orders=2))
    assert len(fake_judge.requests) == 8


async def test_broken_json_is_repaired(fake_judge, group, tmp_path):
    fake_judge.replies = ['{"trajectory_1": {"explanation": "good", "score": 0.9}, "trajectory_2": ']
    usage = JudgeUsage()
    scored = await ruler_score_group(group, **judge_kwargs(fake_judge, tmp_path), usage=usage)
    assert by_city(scored) == {"Paris": 1.0, "Lyon": 0.3, "none": 0.0}
    assert (usage.calls, usage.repairs) == (2, 1)
    repair = fake_judge.requests[1]["messages"]
    assert repair[-2]["role"] == "assistant" and repair[-2]["content"].startswith('{"trajectory_1"')  # shown back
    assert "not valid JSON" in repair[-1]["content"] and "trajectory_3" in repair[-1]["content"]


async def test_too_few_scores_is_a_clear_error_and_rewards_stay(fake_judge, group, tmp_path):
    two = json.dumps({f"trajectory_{k}": {"explanation": "ok", "score": 0.5} for k in (1, 2)})
    fake_judge.default = two
    with pytest.raises(JudgeError, match=r"scored 2 of 3 trajectories: trajectory_3 missing"):
        await ruler_score_group(group, **judge_kwargs(fake_judge, tmp_path, max_repairs=1))
    assert len(fake_judge.requests) == 2  # the answer and one repair
    assert group.rewards == ORIGINAL and not any(t.metrics or t.logs for t in group)


async def test_swallowed_failures_return_none_and_are_counted(fake_judge, group, tmp_path):
    fake_judge.default = "not json at all"
    usage = JudgeUsage()
    result = await ruler_score_group(group, **judge_kwargs(fake_judge, tmp_path, max_repairs=0),
                                     swallow_exceptions=True, usage=usage)
    assert result is None
    assert (usage.failures, usage.calls) == (1, 1)
    assert group.rewards == ORIGINAL


async def test_an_answer_without_choices_is_a_judge_error_swallowed_like_the_others(fake_judge, group, tmp_path):
    fake_judge.default = NO_CHOICES
    with pytest.raises(JudgeError, match="answered with no choices"):
        await ruler_score_group(group, **judge_kwargs(fake_judge, tmp_path))
    usage = JudgeUsage()
    assert await ruler_score_group(group, **judge_kwargs(fake_judge, tmp_path), swallow_exceptions=True,
                                   usage=usage) is None
    assert usage.failures == 1 and group.rewards == ORIGINAL


async def test_a_cache_that_cannot_be_written_keeps_the_answer(fake_judge, group, tmp_path, caplog):
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache folder should be")  # as a read-only or full disk would refuse it
    usage = JudgeUsage()
    with caplog.at_level("WARNING"):
        scored = await ruler_score_group(group, **judge_kwargs(fake_judge, tmp_path), usage=usage)
    assert by_city(scored) == {"Paris": 1.0, "Lyon": 0.3, "none": 0.0} and usage.calls == 1
    assert any("could not write the RULER cache entry" in r.getMessage() for r in caplog.records)


async def test_an_unreachable_judge_is_a_clear_error(group, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(JudgeError, match=rf"judge 'openai/judge' at http://127.0.0.1:{port}/v1 failed"):
        await ruler_score_group(group, "openai/judge", api_base=f"http://127.0.0.1:{port}/v1", api_key="x",
                                cache_dir=None, completion_kwargs={"max_retries": 0})
    assert group.rewards == ORIGINAL


async def test_an_empty_group_is_a_clear_error(fake_judge, tmp_path):
    with pytest.raises(RewardError, match="no trajectories"):
        await ruler_score_group(TrajectoryGroup([]), **judge_kwargs(fake_judge, tmp_path))
    usage = JudgeUsage()
    assert await ruler_score_group(TrajectoryGroup([]), **judge_kwargs(fake_judge, tmp_path),
                                   swallow_exceptions=True, usage=usage) is None
    assert usage.failures == 1 and not fake_judge.requests


async def test_bad_arguments_are_refused_before_any_call(fake_judge, group, tmp_path):
    with pytest.raises(ConfigError, match=r"orders is 0.*max_repairs is -1"):
        await ruler_score_group(group, **judge_kwargs(fake_judge, tmp_path, orders=0, max_repairs=-1),
                                swallow_exceptions=True)  # misuse is raised even when failures are swallowed
    assert not fake_judge.requests


async def test_step_rewards(fake_judge, tmp_path):
    shared = [Message(role="user", content="Find the capital of France.")]
    runs = [
        [Message(role="assistant", content="Let me look it up."), Message(role="tool", content="Paris",
                                                                        tool_call_id="c1"),
         Message(role="assistant", content="Paris.")],
        [Message(role="assistant", content="Lyon.")],
    ]
    group = TrajectoryGroup([Trajectory(messages=[*shared, *run]) for run in runs])

    def per_step(body):
        answer = {}
        for label, block in trajectory_blocks(body).items():
            steps = block.count('"step": ')
            answer[label] = {"explanation": "x", "score": 0.5, "step_scores": [round(0.1 * (k + 1), 1)
                                                                                for k in range(steps)]}
        return json.dumps(answer)

    fake_judge.default = per_step
    scored = await ruler_score_group(group, **judge_kwargs(fake_judge, tmp_path, step_rewards=True))
    assert [ruler_step_scores(t) for t in scored] == [[0.1, 0.2], [0.1]]
    assert scored.trajectories[0].metrics["ruler_step_2"] == 0.2
    steps_schema = fake_judge.requests[0]["response_format"]["json_schema"]["schema"]["properties"]
    assert sorted(s["properties"]["step_scores"]["maxItems"] for s in steps_schema.values()) == [1, 2]


async def test_additional_histories_reach_the_judge(fake_judge, tmp_path):
    group = capital_group()
    group.trajectories[1].additional_histories = [
        {"messages": [{"role": "user", "content": "sub-agent: check the atlas"},
                      {"role": "assistant", "content": "atlas says Paris"}]}]
    scored = await ruler_score_group(group, **judge_kwargs(fake_judge, tmp_path))
    blocks = trajectory_blocks(fake_judge.requests[0])
    lyon = next(block for block in blocks.values() if "Lyon" in block)
    assert '<additional_history index="1">' in lyon and "atlas says Paris" in lyon
    assert scored.trajectories[1].reward == 1.0  # this judge saw "Paris" in that run's sub-agent history


async def test_missing_litellm_names_the_extra(group, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "litellm", None)  # as if not installed
    with pytest.raises(JudgeError, match=r"art-core\[rewards\]"):
        await ruler_score_group(group, "openai/judge", cache_dir=None)
    assert group.rewards == ORIGINAL
