"""Chat files in OpenAI's fine-tuning format: read whole, every problem reported with its line number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from art_core.sft import MAX_PROBLEMS, ChatFileError, read_chat_file, select_for_sft
from art_core.types import Trajectory, TrajectoryGroup

SEARCH = {"type": "function", "function": {"name": "search", "description": "find emails",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
TOOL_CHAT = {
    "messages": [
        {"role": "system", "content": "You search email."},
        {"role": "user", "content": "When is the offsite?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{\"q\": \"offsite\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Offsite: May 3"},
        {"role": "assistant", "content": "May 3.", "weight": 1},
    ],
    "tools": [SEARCH],
}
PLAIN_CHAT = {"messages": [{"role": "user", "content": [{"type": "text", "text": "2+2?"}]},
                           {"role": "assistant", "content": "draft", "weight": 0},
                           {"role": "user", "content": "again"},
                           {"role": "assistant", "content": "4"}]}


def write(tmp_path: Path, *lines: object) -> Path:
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_a_good_file_becomes_trajectories_with_messages_tools_and_weights(tmp_path):
    trajectories = read_chat_file(write(tmp_path, TOOL_CHAT, "", PLAIN_CHAT))
    assert len(trajectories) == 2
    tools_run, plain = trajectories
    assert tools_run.tools == [SEARCH] and tools_run.calls == [] and tools_run.metadata["source"] == "chats.jsonl:1"
    assert [m.role for m in tools_run.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert tools_run.messages[2].tool_calls[0].function.arguments == "{\"q\": \"offsite\"}"
    assert plain.metadata["source"] == "chats.jsonl:3"  # the blank line 2 is skipped, numbering is the file's
    assert plain.messages[1].model_extra == {"weight": 0} and plain.messages[1].text() == "draft"
    assert plain.messages[0].text() == "2+2?"


def test_every_problem_is_named_with_its_line_before_any_work(tmp_path):
    bad_arguments = json.loads(json.dumps(TOOL_CHAT))
    bad_arguments["messages"][2]["tool_calls"][0]["function"]["arguments"] = "{q: offsite"
    unknown_tool = json.loads(json.dumps(TOOL_CHAT))
    unknown_tool["messages"][2]["tool_calls"][0]["function"]["name"] = "delete_all"
    orphan_result = {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "x", "content": "?"},
                                  {"role": "assistant", "content": "ok"}]}
    lines = [
        TOOL_CHAT,                                                      # 1: fine
        "{not json",                                                    # 2
        [1, 2],                                                         # 3
        {"messages": []},                                               # 4
        {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},  # 5
        bad_arguments,                                                  # 6
        unknown_tool,                                                   # 7
        orphan_result,                                                  # 8
        {"messages": [{"role": "user", "content": "only a question"}]},  # 9
        {"messages": PLAIN_CHAT["messages"], "functions": []},          # 10
        {"messages": PLAIN_CHAT["messages"], "extra": 1},               # 11
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0.5}]},  # 12
        {**TOOL_CHAT, "messages": [m for m in TOOL_CHAT["messages"] if m["role"] != "tool"]},   # 13: unanswered
        {"messages": [{"role": "assistant", "content": "Hi!"}, *PLAIN_CHAT["messages"]]},       # 14
        {**TOOL_CHAT, "messages": [*TOOL_CHAT["messages"][:4], TOOL_CHAT["messages"][2],  # 15: an id used twice
                                   TOOL_CHAT["messages"][3], TOOL_CHAT["messages"][4]]},
    ]
    with pytest.raises(ChatFileError) as caught:
        read_chat_file(write(tmp_path, *lines))
    error = caught.value
    message = str(error)
    expected = {
        2: "not valid JSON", 3: "a JSON list, not an object", 4: '"messages" must be a non-empty list',
        5: "has role 'robot'", 6: "arguments are not valid JSON", 7: "calls 'delete_all', which the example's tools",
        8: "answers tool_call_id 'x', which no earlier assistant turn made", 9: "no assistant message to learn from",
        10: '"functions" is the legacy format', 11: "unknown key 'extra'", 12: "has weight 0.5",
        13: "messages[2] (assistant) tool call 'c1' has no tool result before messages[3] (assistant): add a "
            '{"role": "tool", "tool_call_id": "c1"',
        14: "messages[0] (assistant) is the first message, with nothing before it to prompt it",
        15: "tool_calls[0] reuses the id 'c1' of an earlier call",
    }
    for line, text in expected.items():
        assert any(p.startswith(f"line {line}: ") and text in p for p in error.problems), (line, text, message)
    assert not any(p.startswith("line 1: ") for p in error.problems)
    assert "fix them and run again" in message and str(tmp_path / "chats.jsonl") in message


def test_a_chat_may_end_with_the_call_it_trains(tmp_path):
    ends_with_a_call = {**TOOL_CHAT, "messages": TOOL_CHAT["messages"][:3]}  # the trained turn is the call itself
    (trajectory,) = read_chat_file(write(tmp_path, ends_with_a_call))
    assert trajectory.messages[-1].tool_calls and trajectory.messages[-1].tool_calls[0].id == "c1"


def test_a_context_turn_may_call_a_tool_the_example_does_not_offer(tmp_path):
    """A handoff: the first agent's transfer call stays in the second agent's history as context (weight 0), but
    the tools are the second agent's. A trained turn calling an undeclared tool is still refused."""
    handed_off = {**TOOL_CHAT, "messages": [
        TOOL_CHAT["messages"][1],
        {"role": "assistant", "content": None, "weight": 0, "tool_calls": [
            {"id": "h1", "type": "function", "function": {"name": "transfer_to_mail", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "h1", "content": "{\"assistant\": \"Mail\"}"},
        *TOOL_CHAT["messages"][2:]]}
    (trajectory,) = read_chat_file(write(tmp_path, handed_off))
    assert trajectory.messages[1].tool_calls[0].function.name == "transfer_to_mail"
    trained = {**handed_off, "messages": [{**m, "weight": 1} if m.get("weight") == 0 else m
                                          for m in handed_off["messages"]]}
    with pytest.raises(ChatFileError) as caught:
        read_chat_file(write(tmp_path, trained))
    assert any("calls 'transfer_to_mail', which the example's tools do not declare" in p for p in caught.value.problems)


def test_a_long_list_of_problems_is_cut_with_a_count(tmp_path):
    path = write(tmp_path, *["{oops"] * (MAX_PROBLEMS + 5))
    with pytest.raises(ChatFileError) as caught:
        read_chat_file(path)
    assert len(caught.value.problems) == MAX_PROBLEMS and caught.value.total == MAX_PROBLEMS + 5
    assert "... and 5 more" in str(caught.value)


def test_missing_and_empty_files_say_what_was_expected(tmp_path):
    with pytest.raises(FileNotFoundError, match="one chat per line"):
        read_chat_file(tmp_path / "nope.jsonl")
    with pytest.raises(ChatFileError, match="holds no example"):
        read_chat_file(write(tmp_path, "", "   "))


def scored_group(*rewards: float) -> TrajectoryGroup:
    return TrajectoryGroup(trajectories=[Trajectory(id=f"t{r}-{i}", reward=r) for i, r in enumerate(rewards)])


def test_select_for_sft_keeps_the_best_of_each_group_or_those_above_a_reward():
    groups = [scored_group(0.2, 0.9, 0.9, 0.1), scored_group(0.0, 0.5)]
    assert [t.id for t in select_for_sft(groups)] == ["t0.9-1", "t0.5-1"]  # best of each; ties keep their order
    assert [t.id for t in select_for_sft(groups, best_per_group=2)] == ["t0.9-1", "t0.9-2", "t0.5-1", "t0.0-0"]
    assert [t.id for t in select_for_sft(groups, best_per_group=None, min_reward=0.5)] == ["t0.9-1", "t0.9-2",
                                                                                           "t0.5-1"]
    assert select_for_sft(groups, min_reward=2.0) == []
    chosen = select_for_sft(groups)
    chosen[0].reward = -1.0
    assert groups[0].trajectories[1].reward == 0.9  # copies: the groups are untouched
    with pytest.raises(ValueError, match="keep at least 1 per group"):
        select_for_sft(groups, best_per_group=0)
