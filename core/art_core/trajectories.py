"""Rebuild a ``Trajectory`` from the gateway's records of one rollout.

The gateway records every call of a rollout with the conversation it rendered (chat format, whichever
endpoint the agent used) and the reply it gave. An agent run is a sequence of such calls; a call whose
conversation continues an earlier one (the earlier conversation plus its reply, then tool results or a
new user turn) belongs to the same history. A call that does not continue any (the agent trimmed or
summarised its messages, a handoff gave another agent a fresh context, a second LLM node keeps its own
context) starts a new history, so no history is ever a splice of two contexts.

The main history is the one that holds the last call (the context the run ended in); the others become
``additional_histories``. Every call keeps its token-exact ``CallRecord``, so training needs no re-rendering.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import TrajectoryError
from .gateway.records import ExchangeRecord
from .types import CallRecord, History, Message, Trajectory

__all__ = ["trajectory_from_records"]


def trajectory_from_records(records: Sequence[ExchangeRecord], **fields: Any) -> Trajectory:
    """One trajectory from a rollout's records (oldest first), histories split where contexts differ.

    Args:
        records: the rollout's records, e.g. ``TrainableModel.rollout_records(rollout_id)``.
        **fields: other ``Trajectory`` fields (``reward``, ``metadata``...).

    Raises:
        TrajectoryError: ``records`` has no call with a sampled token, or a record predates conversation capture
            (no ``messages``).
    """
    # A call cut before its first token (finish_reason "cancelled") holds nothing to train on or to show.
    records = [r for r in records if r.completion_token_ids]
    if not records:
        raise TrajectoryError("no records to build a trajectory from: the rollout made no call to the trainable model "
                              "that sampled a token")
    histories: list[_Open] = []
    last: _Open | None = None
    for record in records:
        if not record.messages:
            raise TrajectoryError(f"record {record.request_id} holds no conversation (written by an older gateway); "
                                  "re-run the rollout against this version")
        last = _place(record, histories)
    assert last is not None
    main = last.history()
    others = [h.history() for h in histories if h is not last]
    return Trajectory(messages=main.messages, tools=main.tools, calls=main.calls, additional_histories=others,
                      **fields)


@dataclass
class _Open:
    """A history being built: its messages so far (in chat format) and their comparison keys."""

    messages: list[dict[str, Any]]
    keys: list[tuple[Any, ...]]
    tools: list[dict[str, Any]]
    tools_key: str
    calls: list[CallRecord] = field(default_factory=list)

    def history(self) -> History:
        return History(messages=[Message.model_validate(m) for m in self.messages], tools=self.tools, calls=self.calls)


def _place(record: ExchangeRecord, histories: list[_Open]) -> _Open:
    """Append ``record`` to the latest history it continues, or open a new one; returns that history."""
    keys = [_key(m) for m in record.messages]
    tools_key = json.dumps(record.tools, sort_keys=True)
    reply = record.reply or {"role": "assistant", "content": None}
    for history in reversed(histories):
        # choice_index > 0 is a sibling sample of the same prompt: a branch, never a continuation.
        if record.choice_index == 0 and history.tools_key == tools_key and keys[: len(history.keys)] == history.keys:
            break
    else:
        history = _Open(messages=[], keys=[], tools=record.tools, tools_key=tools_key)
        histories.append(history)
    history.messages = [*record.messages, reply]
    history.keys = [*keys, _key(reply)]
    history.calls.append(record.to_call_record())
    return history


def _key(message: dict[str, Any]) -> tuple[Any, ...]:
    """What must match for two messages to be the same turn.

    Clients re-serialise what they send back: content ``None`` becomes ``""``, tool-call arguments are
    re-dumped with other spacing, ids may be rewritten. Those differences are not a different context.
    """
    role = "system" if message.get("role") == "developer" else message.get("role")
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    calls = tuple((c.get("function", {}).get("name"), _canonical(c.get("function", {}).get("arguments")))
                  for c in message.get("tool_calls") or [])
    return role, (content or "").strip(), calls


def _canonical(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True)
