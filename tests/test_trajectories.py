"""``trajectory_from_records``: one history per distinct context, whatever the client re-serialised."""

from __future__ import annotations

from typing import Any

import pytest

from art_core.errors import TrajectoryError
from art_core.gateway.records import ExchangeRecord
from art_core.trajectories import trajectory_from_records

SYSTEM = {"role": "system", "content": "Use the tools."}
USER = {"role": "user", "content": "What is 2 + 2?"}
CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "4"}
ANSWER = {"role": "assistant", "content": "It is 4."}


def record(n: int, messages: list[dict[str, Any]], reply: dict[str, Any], **extra: Any) -> ExchangeRecord:
    return ExchangeRecord(request_id=f"req-{n}", rollout_id="r", model="agent", adapter_step=0, request={},
                          prompt_token_ids=[1, 2, n], completion_token_ids=[n, 2], logprobs=[-0.1, -0.2],
                          finish_reason="stop", messages=messages, reply=reply, **extra)


def test_a_continued_conversation_is_one_history_even_when_the_client_reserialises_it():
    echoed_call = {**CALL, "content": "", "tool_calls": [  # as LangChain sends it back: "" and other spacing, new id
        {"id": "other", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":2}'}}]}
    trajectory = trajectory_from_records([
        record(1, [SYSTEM, USER], CALL),
        record(2, [SYSTEM, USER, echoed_call, RESULT], ANSWER, caller="agent"),
    ])
    assert [m.role for m in trajectory.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert trajectory.messages[-1].text() == "It is 4."
    assert [c.request_id for c in trajectory.calls] == ["req-1", "req-2"]
    assert trajectory.calls[1].caller == "agent"
    assert not trajectory.additional_histories


def test_a_rewritten_context_starts_another_history_and_the_last_one_is_main():
    trimmed = [SYSTEM, CALL, RESULT]
    trajectory = trajectory_from_records([record(1, [SYSTEM, USER], CALL), record(2, trimmed, ANSWER)])
    assert [m.role for m in trajectory.messages] == ["system", "assistant", "tool", "assistant"]
    (first,) = trajectory.additional_histories
    assert [m.role for m in first.messages] == ["system", "user", "assistant"]
    assert [c.request_id for c in first.calls] == ["req-1"]


def test_different_tools_mean_a_different_context():
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    trajectory = trajectory_from_records([
        record(1, [SYSTEM, USER], CALL, tools=[tool]),
        record(2, [SYSTEM, USER, CALL, RESULT], ANSWER),  # same messages, but offered no tools
    ])
    assert len(trajectory.additional_histories) == 1 and trajectory.tools == []


def test_sibling_choices_are_branches_not_continuations():
    records = [record(1, [SYSTEM, USER], CALL), record(1, [SYSTEM, USER], ANSWER, choice_index=1)]
    trajectory = trajectory_from_records(records)
    assert len(trajectory.histories()) == 2


def test_the_main_history_holds_the_choice_the_agent_continued_when_the_last_call_sampled_several():
    # LangChain's ChatOpenAI(n=2) and the SDKs read choice 0; the run ended in its context, not in the sibling's.
    records = [record(1, [SYSTEM, USER], CALL), record(1, [SYSTEM, USER], ANSWER, choice_index=1)]
    trajectory = trajectory_from_records(records)
    assert trajectory.messages[-1].tool_calls and [c.request_id for c in trajectory.calls] == ["req-1"]
    (sibling,) = trajectory.additional_histories
    assert sibling.messages[-1].text() == ANSWER["content"]


def test_a_sibling_is_main_only_when_the_first_choice_sampled_nothing():
    cut = record(1, [SYSTEM, USER], CALL).model_copy(update={"completion_token_ids": [], "logprobs": []})
    trajectory = trajectory_from_records([cut, record(1, [SYSTEM, USER], ANSWER, choice_index=1)])
    assert trajectory.messages[-1].text() == ANSWER["content"] and trajectory.additional_histories == []


def test_no_records_is_a_clear_error():
    with pytest.raises(TrajectoryError, match="no call to the trainable model"):
        trajectory_from_records([])
