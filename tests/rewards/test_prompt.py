"""What the RULER judge reads (``_prompt.py``) and how its answer is checked (``_answer.py``)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from fake_judges import capital_group

from art_core.rewards import DEFAULT_RUBRIC
from art_core.rewards._answer import MalformedAnswer, parse_answer
from art_core.rewards._prompt import build_judge_prompt, render_message, shared_prefix_length
from art_core.types import Message, Trajectory


def user_text(prompt) -> str:
    return prompt.messages[1]["content"]


def test_the_shared_prefix_is_shown_once():
    prompt = build_judge_prompt(capital_group().trajectories, rubric=DEFAULT_RUBRIC)
    text = user_text(prompt)
    assert prompt.shared_prefix == 2  # system + user message, common to all three runs
    assert text.count("What is the capital of France?") == 1
    assert text.index("<shared_context>") < text.index("What is the capital") < text.index("</shared_context>")
    for label, answer in zip(prompt.labels, ["Paris.", "Lyon.", "I do not know."], strict=True):
        block = text.split(f'<trajectory id="{label}">\n', 1)[1].split("</trajectory>", 1)[0]
        assert answer in block and "capital of France?" not in block
        assert json.loads(block)["role"] == "assistant"  # one JSON object per message
    assert prompt.messages[0]["role"] == "system" and "3 trajectories" in prompt.messages[0]["content"]
    assert DEFAULT_RUBRIC in text


def test_the_prefix_stops_where_runs_differ_and_leaves_each_run_something():
    a = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}]
    b = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}, {"role": "user", "content": "else"}]
    assert shared_prefix_length([a, b]) == 2
    assert shared_prefix_length([a, a]) == 2  # identical runs still keep their last message to be judged
    assert shared_prefix_length([a, b], stop_at_assistant=True) == 1  # step scores: steps are never shared
    assert shared_prefix_length([a[:1], b]) == 0
    assert shared_prefix_length([]) == 0


def test_tools_are_included_once_when_shared_and_per_run_otherwise():
    runs = capital_group().trajectories
    shared = user_text(build_judge_prompt(runs, rubric="r"))
    assert shared.count('"name": "lookup"') == 1
    assert shared.index("<tools>") < shared.index('<trajectory id="trajectory_1">')

    other = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    runs[2].tools = other
    mixed = user_text(build_judge_prompt(runs, rubric="r"))
    assert mixed.count('"name": "lookup"') == 2 and mixed.count('"name": "search"') == 1
    third = mixed.split('<trajectory id="trajectory_3">', 1)[1]
    assert third.lstrip().startswith("<tools>") and '"search"' in third


def test_messages_render_tool_calls_and_leave_images_out():
    call = Message(role="assistant", content=None,
                   tool_calls=[{"id": "c1", "function": {"name": "lookup", "arguments": '{"city": "Paris"}'}}])
    assert render_message(call) == {"role": "assistant", "tool_calls": [
        {"id": "c1", "name": "lookup", "arguments": '{"city": "Paris"}'}]}
    result = Message(role="tool", content="Paris is the capital", tool_call_id="c1")
    assert render_message(result) == {"role": "tool", "content": "Paris is the capital", "tool_call_id": "c1"}
    image = Message(role="user", content=[{"type": "text", "text": "what is this?"},
                                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])
    assert render_message(image)["content"] == [{"type": "text", "text": "what is this?"}, {"type": "image_url"}]


def test_the_answer_schema_asks_for_every_label_in_order():
    prompt = build_judge_prompt(capital_group().trajectories, rubric="r", explanation_max_chars=50)
    good = {label: {"explanation": "fine", "score": 0.5} for label in prompt.labels}
    jsonschema.validate(good, prompt.schema)
    assert prompt.schema["required"] == ["trajectory_1", "trajectory_2", "trajectory_3"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**good, "trajectory_1": {"explanation": "x" * 51, "score": 0.5}}, prompt.schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**good, "trajectory_1": {"explanation": "x", "score": 1.5}}, prompt.schema)
    # scores are hundredths: a constrained judge cannot write digits until its token limit
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**good, "trajectory_1": {"explanation": "x", "score": 0.1223333}}, prompt.schema)
    for score in (0, 0.07, 0.12, 1):
        jsonschema.validate({**good, "trajectory_1": {"explanation": "x", "score": score}}, prompt.schema)


def test_step_rewards_number_the_assistant_messages():
    runs = [Trajectory(messages=[Message(role="user", content="go"), Message(role="assistant", content=f"s{i}"),
                                 Message(role="assistant", content="done")]) for i in range(2)]
    prompt = build_judge_prompt(runs, rubric="r", step_rewards=True)
    assert prompt.step_counts == [2, 2] and prompt.shared_prefix == 1
    assert '{"role": "assistant", "content": "s0", "step": 1}' in user_text(prompt)
    entry = prompt.schema["properties"]["trajectory_1"]
    assert entry["required"] == ["explanation", "score", "step_scores"]
    assert entry["properties"]["step_scores"]["minItems"] == 2


@pytest.mark.parametrize(("answer", "problem"), [
    ("", "empty"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON list, not an object"),
    ('{"trajectory_1": {"explanation": "a", "score": 1}}', "scored 1 of 3 trajectories: trajectory_2, trajectory_3"),
    ('{"trajectory_1": {"explanation": "", "score": 1}, "trajectory_2": {"explanation": "", "score": 0}, '
     '"trajectory_3": {"explanation": "", "score": 0}, "trajectory_9": {"score": 0}}',
     "no trajectory id: trajectory_9"),
    ('{"trajectory_1": {"explanation": "a", "score": 1.5}, "trajectory_2": {"explanation": "", "score": 0}, '
     '"trajectory_3": {"explanation": "", "score": 0}}', "trajectory_1.score is 1.5, outside 0 to 1"),
    ('{"trajectory_1": {"explanation": "a", "score": true}, "trajectory_2": {"explanation": "", "score": 0}, '
     '"trajectory_3": {"explanation": "", "score": 0}}', "trajectory_1.score is true, not a number"),
    ('{"trajectory_1": 0.5, "trajectory_2": 0.1, "trajectory_3": 0.2}', "trajectory_1 is a JSON float"),
])
def test_malformed_answers_say_what_is_wrong(answer, problem):
    prompt = build_judge_prompt(capital_group().trajectories, rubric="r")
    with pytest.raises(MalformedAnswer, match=problem):
        parse_answer(answer, prompt)


def test_a_fenced_answer_is_read():
    prompt = build_judge_prompt(capital_group().trajectories, rubric="r")
    body = {label: {"explanation": " ok ", "score": i / 2} for i, label in enumerate(prompt.labels)}
    judged = parse_answer(f"```json\n{json.dumps(body)}\n```", prompt)
    assert [j.score for j in judged.values()] == [0.0, 0.5, 1.0] and judged["trajectory_1"].explanation == "ok"
