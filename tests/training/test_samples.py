"""Trajectories -> samples: token-exact merging, the re-rendered fallback and its mask, bad input."""

from __future__ import annotations

import math

import pytest
from transformers import AutoTokenizer

from art_core import CallRecord, Trajectory, TrajectoryError
from art_core.models.templates import ORIGINAL_CHAT_TEMPLATE_FILE
from art_core.training.samples import Sample, attribute_behaviour, trajectory_samples

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def tool_tokenizer(smollm2_dir):
    """The embedded model's tokenizer with our Qwen2.5-style tool template."""
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def original_tokenizer(smollm2_dir):
    """The same tokenizer with SmolLM2's own (tool-less) template."""
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.chat_template = (smollm2_dir / ORIGINAL_CHAT_TEMPLATE_FILE).read_text()
    return tok


def _trained_text(tokenizer, sample: Sample) -> list[str]:
    """Decode each maximal run of trained tokens."""
    runs, current = [], []
    for tok, trained in zip(sample.token_ids, sample.trained):
        if trained:
            current.append(tok)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def test_calls_that_extend_each_other_merge_into_one_sample():
    first = CallRecord(prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5], logprobs=[-0.1, -0.2])
    # The second prompt is the first prompt + completion + a tool result [6, 7].
    second = CallRecord(prompt_token_ids=[1, 2, 3, 4, 5, 6, 7], completion_token_ids=[8], logprobs=[-0.3])
    (sample,) = trajectory_samples(Trajectory(calls=[first, second]))
    assert sample.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert sample.trained == [False, False, False, True, True, False, False, True]
    got = [x for x in sample.sampler_logprobs if not math.isnan(x)]
    assert got == [-0.1, -0.2, -0.3]
    assert not sample.rerendered


def test_a_call_with_a_rewritten_prompt_starts_a_new_sample():
    first = CallRecord(prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5])
    trimmed = CallRecord(prompt_token_ids=[1, 9, 4, 5], completion_token_ids=[6])  # history was rewritten
    samples = trajectory_samples(Trajectory(calls=[first, trimmed]))
    assert [s.token_ids for s in samples] == [[1, 2, 3, 4, 5], [1, 9, 4, 5, 6]]
    assert [s.trained for s in samples] == [[False, False, False, True, True], [False] * 4 + [True]]
    assert all(math.isnan(x) for s in samples for x in s.sampler_logprobs)  # no logprobs recorded


def test_rerendered_mask_covers_only_assistant_tokens_with_tools(tool_tokenizer):
    messages = [
        {"role": "system", "content": "You answer weather questions."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21C"},
        {"role": "assistant", "content": "It is sunny in Paris."},
    ]
    (sample,) = trajectory_samples(Trajectory(messages=messages, tools=[WEATHER_TOOL]), tool_tokenizer)
    assert sample.rerendered
    runs = _trained_text(tool_tokenizer, sample)
    assert len(runs) == 2
    assert "<tool_call>" in runs[0] and '"Paris"' in runs[0] and runs[0].endswith("<|im_end|>")
    assert runs[1] == "It is sunny in Paris.<|im_end|>"
    text = tool_tokenizer.decode(sample.token_ids)
    assert "get_weather" in text.split("<|im_start|>user")[0]  # the schema is in the (untrained) system turn
    assert "sunny, 21C" not in "".join(runs)


def test_rerendered_on_the_embedded_models_own_template(original_tokenizer):
    messages = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"},
                {"role": "user", "content": "Again."}, {"role": "assistant", "content": "Hi again!"}]
    (sample,) = trajectory_samples(Trajectory(messages=messages), original_tokenizer)
    assert _trained_text(original_tokenizer, sample) == ["Hi!<|im_end|>", "Hi again!<|im_end|>"]
    assert "SmolLM" in original_tokenizer.decode(sample.token_ids)  # its default system prompt, untrained


def test_token_exact_and_rerendered_agree_on_what_is_trained(tool_tokenizer):
    messages = [{"role": "user", "content": "2+2?"}]
    prompt = tool_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    completion = tool_tokenizer.encode("4<|im_end|>", add_special_tokens=False)
    exact = Trajectory(messages=[*messages, {"role": "assistant", "content": "4"}],
                       calls=[CallRecord(prompt_token_ids=list(prompt), completion_token_ids=completion)])
    rerendered = exact.model_copy(update={"calls": []})
    (a,) = trajectory_samples(exact, tool_tokenizer)
    (b,) = trajectory_samples(rerendered, tool_tokenizer)
    assert a.token_ids == b.token_ids[: len(a.token_ids)]
    assert a.trained == b.trained[: len(a.trained)] and not any(b.trained[len(a.trained):])


def test_no_assistant_turn_is_an_error_naming_the_trajectory():
    trajectory = Trajectory(id="t-empty", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(TrajectoryError, match="t-empty.*no assistant turn"):
        trajectory_samples(trajectory)


def test_a_trained_first_turn_with_nothing_before_it_says_so(tool_tokenizer):
    opening = [{"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "2+2?"},
               {"role": "assistant", "content": "4"}]
    with pytest.raises(TrajectoryError, match="t-open.*first message is a trained assistant turn.*weight 0"):
        trajectory_samples(Trajectory(id="t-open", messages=opening), tool_tokenizer)
    untrained = [{**opening[0], "weight": 0}, *opening[1:]]  # context only: the later turn trains
    (sample,) = trajectory_samples(Trajectory(messages=untrained), tool_tokenizer)
    assert _trained_text(tool_tokenizer, sample) == ["4<|im_end|>"]


@pytest.mark.parametrize("weight", [0.5, 2, True])
def test_a_weight_other_than_0_or_1_is_refused_not_read_as_1(tool_tokenizer, weight):
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "weight": weight}]
    with pytest.raises(TrajectoryError, match=rf"t-w.*assistant message 1 has weight {weight!r}: give 0"):
        trajectory_samples(Trajectory(id="t-w", messages=messages), tool_tokenizer)


def test_rerendering_without_a_tokenizer_says_how_to_fix():
    trajectory = Trajectory(id="t-1", messages=[{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "yo"}])
    with pytest.raises(TrajectoryError, match="t-1.*pass the tokenizer"):
        trajectory_samples(trajectory)


def test_mismatched_ids_and_mask_name_the_trajectory():
    with pytest.raises(TrajectoryError, match="t-9.*3 token ids but 2 mask entries"):
        Sample("t-9", [1, 2, 3], [False, True], [math.nan] * 3)


def test_samples_carry_the_adapter_step_that_sampled_them():
    first = CallRecord(prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5], logprobs=[-0.1, -0.2], adapter_step=3)
    second = CallRecord(prompt_token_ids=[1, 2, 3, 4, 5, 6], completion_token_ids=[7], logprobs=[-0.3], adapter_step=2)
    other = CallRecord(prompt_token_ids=[9, 9], completion_token_ids=[8], logprobs=[-0.4], adapter_step=5)
    merged, alone = trajectory_samples(Trajectory(calls=[first, second, other]))
    assert merged.sampling_step == 2  # the oldest of the calls merged into it
    assert alone.sampling_step == 5
    assert merged.behaviour_logprobs is None and alone.behaviour_logprobs is None  # on-policy unless attributed
    unknown = trajectory_samples(Trajectory(calls=[CallRecord(prompt_token_ids=[1], completion_token_ids=[2])]))
    assert unknown[0].sampling_step is None


def test_older_samples_take_their_sampler_logprobs_as_behaviour_logprobs():
    calls = [CallRecord(prompt_token_ids=[1, 2], completion_token_ids=[3, 4], logprobs=[-0.5, -0.25], adapter_step=s)
             for s in (1, 2)]
    old, current = (trajectory_samples(Trajectory(calls=[c]))[0] for c in calls)
    assert attribute_behaviour([old, current], policy_step=2) == 1
    assert old.behaviour_logprobs is not None and old.behaviour_logprobs[2:] == [-0.5, -0.25]
    assert all(math.isnan(x) for x in old.behaviour_logprobs[:2])  # the prompt: not trained
    assert current.behaviour_logprobs is None  # sampled by the step the module is at: on-policy


def test_behaviour_logprobs_of_the_wrong_length_name_the_trajectory():
    with pytest.raises(TrajectoryError, match="t-8.*3 token ids but 2 behaviour log-probs"):
        Sample("t-8", [1, 2, 3], [False, True, True], [math.nan] * 3, behaviour_logprobs=[-0.1, -0.2])
