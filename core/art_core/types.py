"""What a rollout produces: messages, tool schemas, token-exact call records, reward.

A ``Trajectory`` is one agent run. Its ``messages`` are OpenAI chat-format messages, in order, with
assistant tool calls and tool results; ``tools`` are the OpenAI function-tool schemas the model saw.
``calls`` hold, for each call to the trainable model, the exact prompt token ids the engine saw, the
completion token ids it sampled, and the sampler's log-probabilities: the trainer learns from these
tokens, not from a re-rendering of the messages (see ``training/samples.py``).

A ``TrajectoryGroup`` is several runs of the same task: GRPO compares rewards within a group.

Groups round-trip through JSONL, one group per line (``write_groups_jsonl`` / ``read_groups_jsonl``).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from .errors import ConfigError, TrajectoryError

__all__ = [
    "CallRecord",
    "FunctionCall",
    "History",
    "Message",
    "ToolCall",
    "Trajectory",
    "TrajectoryGroup",
    "chat_messages",
    "read_groups_jsonl",
    "trace_links",
    "write_groups_jsonl",
]

Scalar = float | int | bool
MetadataValue = str | int | float | bool | None


class _Model(BaseModel):
    # Unknown keys are an error: a typo in a field name should not vanish silently.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class FunctionCall(_Model):
    name: str
    """Name of the function the model called."""
    arguments: str = "{}"
    """Arguments as the JSON text the model wrote (kept verbatim, even when it is not valid JSON)."""


class ToolCall(_Model):
    id: str
    """Id that the matching tool message's ``tool_call_id`` refers to."""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Model):
    """One chat message in OpenAI format."""

    # Providers add fields (``refusal``, ``annotations``, ``reasoning_content``...): keep them.
    model_config = ConfigDict(extra="allow", validate_assignment=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    """Text, or a list of OpenAI content parts. ``None`` for an assistant turn that only calls tools."""
    tool_calls: list[ToolCall] | None = None
    """Tool calls made by an assistant turn."""
    tool_call_id: str | None = None
    """For ``role="tool"``: the id of the call this message answers."""
    name: str | None = None

    def text(self) -> str:
        """The message's text content, with content parts joined."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(part.get("text", "")) for part in self.content)


def chat_messages(messages: Iterable[Any], *, where: str) -> list[Message]:
    """``messages`` (OpenAI chat-format dicts) as ``Message`` objects, checked before any work is done on them.

    Raises:
        ConfigError: naming ``where``, the first bad message's index, and what is wrong with it.
    """
    out = []
    for i, message in enumerate(messages):
        try:
            out.append(Message.model_validate(message))
        except ValidationError as exc:
            problem = exc.errors()[0]
            field = ".".join(str(part) for part in problem["loc"]) or "message"
            raise ConfigError(
                f"{where}: message {i} is not a chat message ({field}: {problem['msg']}; got {message!r:.200}): "
                "give dicts like {'role': 'user', 'content': '...'}, with role one of system, developer, user, "
                "assistant, tool") from None
    return out


class CallRecord(_Model):
    """One call to the trainable model, token-exact, as the engine saw and produced it."""

    prompt_token_ids: list[int]
    """Token ids of the whole prompt the engine ran (the rendered chat template)."""
    completion_token_ids: list[int]
    """Token ids the engine sampled, including the end-of-turn token when it stopped on one."""
    logprobs: list[float] | None = None
    """The sampler's log-probability of each completion token; ``None`` when the engine did not report them."""
    adapter_step: int | None = None
    """Checkpoint step of the LoRA adapter that served the call (0 = the base model)."""
    finish_reason: str | None = None
    request_id: str | None = None
    """Id of the gateway record this call came from."""
    rollout_id: str | None = None
    caller: str | None = None
    """Which part of the agent made the call: a LangGraph node, an Agents SDK agent's name."""

    @model_validator(mode="after")
    def _lengths_match(self) -> CallRecord:
        if not self.completion_token_ids:
            raise ValueError("completion_token_ids is empty: a call with no sampled token cannot be trained on")
        if self.logprobs is not None and len(self.logprobs) != len(self.completion_token_ids):
            raise ValueError(
                f"logprobs has {len(self.logprobs)} entries but completion_token_ids has "
                f"{len(self.completion_token_ids)}: pass one logprob per sampled token, or logprobs=None"
            )
        return self


class History(_Model):
    """A conversation the model saw, when a run's context was rewritten (trimming, handoffs)."""

    messages: list[Message]
    tools: list[dict[str, Any]] = Field(default_factory=list)
    calls: list[CallRecord] = Field(default_factory=list)


class Trajectory(_Model):
    """One agent run: what the model saw and did, and how well it went."""

    id: str = Field(default_factory=lambda: uuid.uuid4().hex[:12])
    """Stable id, used in error messages and file names."""
    messages: list[Message] = Field(default_factory=list)
    """Every message in order: system, user, assistant (with tool calls), tool results."""
    tools: list[dict[str, Any]] = Field(default_factory=list)
    """OpenAI function-tool schemas the model was offered."""
    calls: list[CallRecord] = Field(default_factory=list)
    """Token-exact records of the calls to the trainable model, in order. Empty: the trainer re-renders."""
    reward: float = 0.0
    """Scalar reward of the run. NaN and infinities are refused."""
    metrics: dict[str, Scalar] = Field(default_factory=dict)
    """Numbers to log with the run (reward components, tool-call counts...)."""
    metadata: dict[str, MetadataValue] = Field(default_factory=dict)
    """Labels (task id, split, framework...)."""
    logs: list[str] = Field(default_factory=list)
    """Free-text notes: judge explanations, errors caught during the run."""
    additional_histories: list[History] = Field(default_factory=list)
    """Other contexts of the same run, each trained on as its own sample(s)."""
    _final_state: Any = PrivateAttr(default=None)

    @property
    def final_state(self) -> Any:
        """What the run ended with (a graph's final state, an agent's final output), for reward functions.

        Kept in memory only: it is not serialised with the trajectory.
        """
        return self._final_state

    @final_state.setter
    def final_state(self, value: Any) -> None:
        self._final_state = value

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> Trajectory:
        # Scorers return deep copies; the run's end state is shared with them, not copied: it may hold
        # anything (clients, locks, large objects) and is only ever read.
        memo = {} if memo is None else memo
        memo[id(self._final_state)] = self._final_state
        return super().__deepcopy__(memo)

    @field_validator("messages", mode="before")
    @classmethod
    def _coerce_messages(cls, value: Any) -> Any:
        return list(value) if isinstance(value, tuple) else value

    @model_validator(mode="after")
    def _finite_reward(self) -> Trajectory:
        if not math.isfinite(self.reward):
            raise ValueError(
                f"trajectory {self.id!r} has reward {self.reward}: rewards must be finite numbers; "
                "check the reward function for a division by zero or a missing score"
            )
        return self

    def histories(self) -> list[History]:
        """The main history followed by the additional ones."""
        main = History(messages=self.messages, tools=self.tools, calls=self.calls)
        return [main, *self.additional_histories]


class TrajectoryGroup(_Model):
    """Several runs of one task. GRPO's advantages compare rewards within a group."""

    trajectories: list[Trajectory]
    metadata: dict[str, MetadataValue] = Field(default_factory=dict)
    exceptions: list[str] = Field(default_factory=list)
    """Rollouts of this group that failed, as ``"ExceptionType: message"``: counted, never silently dropped."""

    def __init__(self, trajectories: Iterable[Trajectory] | None = None, /, **data: Any) -> None:
        if trajectories is not None:
            data["trajectories"] = list(trajectories)
        super().__init__(**data)

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self):  # type: ignore[override]  # iterate trajectories, not pydantic fields
        return iter(self.trajectories)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]


def write_groups_jsonl(path: str | Path, groups: Iterable[TrajectoryGroup]) -> Path:
    """Write groups to ``path``, one JSON object per line, atomically (temporary file + rename).

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for group in groups:
            f.write(group.model_dump_json())
            f.write("\n")
    tmp.replace(path)
    return path


def read_groups_jsonl(path: str | Path) -> list[TrajectoryGroup]:
    """Read groups written by ``write_groups_jsonl``.

    Raises:
        TrajectoryError: a line is not a valid group; the message names the file, line and field.
    """
    path = Path(path)
    groups = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                groups.append(TrajectoryGroup.model_validate_json(line))
            except ValidationError as exc:
                raise TrajectoryError(f"{path}:{lineno}: not a valid TrajectoryGroup:\n{exc}") from exc
    return groups


TRACE_ID_KEY = "langfuse_trace_id"
"""``Trajectory.metadata`` key under which an observability layer (``art_plugins.langfuse``) stores the run's
trace id; art_core only copies these ids into ``history.jsonl``."""


def trace_links(groups: Iterable[TrajectoryGroup]) -> dict[str, list[str]]:
    """``{"langfuse_trace_ids": [...]}``: the trace ids the groups' trajectories carry, for a history row.

    Empty (no key) when no trajectory has one, so rows of untraced runs stay as they were.
    """
    ids = [str(t.metadata[TRACE_ID_KEY]) for g in groups for t in g.trajectories if t.metadata.get(TRACE_ID_KEY)]
    return {"langfuse_trace_ids": ids} if ids else {}
