"""Rebuild a ``Trajectory`` from the gateway's records of one rollout.

The gateway records every call of a rollout with the conversation it rendered (chat format, whichever
endpoint the agent used) and the reply it gave. An agent run is a sequence of such calls; a call whose
conversation continues an earlier one (the earlier conversation plus its reply, then tool results or a
new user turn) belongs to the same history. A call that does not continue any (the agent trimmed or
summarised its messages, a handoff gave another agent a fresh context, a second LLM node keeps its own
context) starts a new history, so no history is ever a splice of two contexts.

The main history is the one that holds the last call (the context the run ended in); when that call sampled
several choices (``n > 1``), the one holding its first choice, which is the one agent frameworks read and act on.
The others become ``additional_histories``. Every call keeps its token-exact ``CallRecord``, so training needs no
re-rendering.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import TrajectoryError
from .gateway.records import ExchangeRecord
from .types import CallRecord, History, Message, Trajectory

__all__ = ["Conversation", "trajectory_from_conversations", "trajectory_from_records"]


def trajectory_from_records(records: Sequence[ExchangeRecord], *, main_caller: str | None = None,
                            **fields: Any) -> Trajectory:
    """One trajectory from a rollout's records (oldest first), histories split where contexts differ.

    Args:
        records: the rollout's records, e.g. ``TrainableModel.rollout_records(rollout_id)``.
        main_caller: the caller (``ExchangeRecord.caller``: an Agents SDK agent's name) the run ended with: the
            history of its last call is the main one. None, or a caller with no call here: the history of the
            rollout's last call. (A run's last call is not always its own agent's: an output guardrail's checker
            agent, or an agent used as a tool that ends the run, calls after it.)
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
    first_choice: dict[str, int] = {}  # each request's lowest choice that sampled a token
    for record in records:
        first_choice[record.request_id] = min(record.choice_index, first_choice.get(record.request_id, 1 << 30))
    histories: list[_Open] = []
    last: _Open | None = None
    last_of_main_caller: _Open | None = None
    for record in records:
        if not record.messages:
            raise TrajectoryError(f"record {record.request_id} holds no conversation (written by an older gateway); "
                                  "re-run the rollout against this version")
        placed = _place(record.messages, record.tools, record.reply, histories, branch=record.choice_index > 0,
                        call=record.to_call_record())
        # A sibling choice (n > 1) never becomes the main history: LangChain and the SDKs continue choice 0, so the
        # run ended in its context (a sibling stands in only when choice 0 sampled nothing and was dropped above).
        if record.choice_index == first_choice[record.request_id]:
            last = placed
            if main_caller is not None and record.caller == main_caller:
                last_of_main_caller = placed
    main, others = _main_and_others(histories, last_of_main_caller or last)
    return Trajectory(messages=main.messages, tools=main.tools, calls=main.calls, additional_histories=others,
                      **fields)


class Conversation(Protocol):
    """One model call as a conversation: what was sent, and the reply (no token ids)."""

    @property
    def messages(self) -> list[dict[str, Any]]: ...  # the conversation sent, in chat format

    @property
    def tools(self) -> list[dict[str, Any]]: ...  # chat-format function-tool schemas offered

    @property
    def reply(self) -> dict[str, Any]: ...  # the assistant message answered

    @property
    def caller(self) -> str | None: ...  # who made the call (an Agents SDK agent's name), when known


def trajectory_from_conversations(calls: Sequence[Conversation], *, main_caller: str | None = None,
                                  **fields: Any) -> Trajectory:
    """One trajectory from calls that carry no token ids (a teacher's demonstrations), split into histories
    exactly as ``trajectory_from_records`` splits a rollout's records (``main_caller`` too); ``calls`` stays
    empty (the trainer renders the messages with the student's chat template). Assistant messages that were
    sent rather than answered by these calls get ``"weight": 0``: the replies are what SFT learns.

    Raises:
        TrajectoryError: ``calls`` is empty.
    """
    if not calls:
        raise TrajectoryError("no calls to build a trajectory from: the run made no model call that was answered")
    histories: list[_Open] = []
    last = last_of_main_caller = None
    for call in calls:
        last = _place(call.messages, call.tools, call.reply, histories, branch=False, call=None)
        if main_caller is not None and call.caller == main_caller:
            last_of_main_caller = last
    # No token ids: the trainer learns the assistant messages not weighted 0, so only the teacher's replies may
    # be unweighted (a few-shot example in the prompt, or a turn from before the demonstration, is context).
    main, others = _main_and_others(histories, last_of_main_caller or last, replies_only=True)
    return Trajectory(messages=main.messages, tools=main.tools, additional_histories=others, **fields)


def _main_and_others(histories: list[_Open], main: _Open | None, *,
                     replies_only: bool = False) -> tuple[History, list[History]]:
    """The main history and the others, in order."""
    assert main is not None
    return (main.history(replies_only=replies_only),
            [h.history(replies_only=replies_only) for h in histories if h is not main])


@dataclass
class _Open:
    """A history being built: its messages so far (in chat format) and their comparison keys."""

    messages: list[dict[str, Any]]
    keys: list[tuple[Any, ...]]
    tools: list[dict[str, Any]]
    tools_key: str
    calls: list[CallRecord] = field(default_factory=list)
    replies: set[int] = field(default_factory=set)
    """Indices in ``messages`` of the replies this history's calls got (the rest was sent to the model)."""

    def history(self, *, replies_only: bool = False) -> History:
        """The history; ``replies_only``: assistant messages that were sent, not answered here (a prompt's few-shot
        example, an earlier run's turn), get ``"weight": 0``, so training learns only the replies."""
        messages = [{**m, "weight": 0} if replies_only and m.get("role") == "assistant" and k not in self.replies
                    else m for k, m in enumerate(self.messages)]
        return History(messages=[Message.model_validate(m) for m in messages], tools=self.tools, calls=self.calls)


def _place(messages: list[dict[str, Any]], tools: list[dict[str, Any]], reply: dict[str, Any],
           histories: list[_Open], *, branch: bool, call: CallRecord | None) -> _Open:
    """Append a call (``messages`` sent, ``reply`` got) to the latest history it continues, or open a new one;
    returns that history. ``branch``: a sibling sample of a prompt (choice_index > 0), never a continuation."""
    keys = [_key(m) for m in messages]
    tools_key = json.dumps(tools, sort_keys=True)
    reply = reply or {"role": "assistant", "content": None}
    for history in reversed(histories):
        if not branch and history.tools_key == tools_key and keys[: len(history.keys)] == history.keys:
            break
    else:
        history = _Open(messages=[], keys=[], tools=tools, tools_key=tools_key)
        histories.append(history)
    history.messages = [*messages, reply]
    history.keys = [*keys, _key(reply)]
    history.replies.add(len(messages))
    if call is not None:
        history.calls.append(call)
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
