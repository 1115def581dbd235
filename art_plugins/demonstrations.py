"""Demonstrations from a stronger model, running the same unchanged agent.

    from art_plugins import Teacher
    from art_plugins.langgraph import trainable

    agent = trainable(graph, model)
    async with agent.demonstrations(Teacher(model="openai/gpt-4.1")) as demo:    # any litellm model string
        trajectories = [await demo.rollout(task) for task in tasks]
    await model.train_sft(trajectories)

While a ``demonstrations(...)`` scope is open, the calls the agent makes to the trainable model go to the
teacher instead of the gateway: a small recording proxy on 127.0.0.1 (``_teacher_proxy.py``) takes them, exactly
where the gateway would (the adapters route to it the same way), asks the teacher for a chat completion and
answers in the API the agent used (chat completions or Responses, streamed or not). Each exchange is recorded as
the gateway records a call: the conversation in chat format and the reply. The rollout's trajectory is built from
those exchanges, one history per distinct context as usual, with no token ids (``calls`` is empty: the student's
chat template renders the messages at SFT time) and ``metadata["demonstration"] = True``,
``metadata["teacher"]`` naming the teacher. Nothing reaches the gateway; the model need not even be registered.

The teacher is asked in chat completions whatever API the agent speaks, as a whole answer (not streamed): any
OpenAI-compatible server has that endpoint, a Responses-API agent can learn from a teacher that lacks
``/v1/responses``, the conversation recorded is the one the gateway would have recorded (the same translation),
and a teacher's error arrives before anything is sent to the agent, so it can be answered as an HTTP error
naming the teacher. Streamed calls get the whole answer as a stream of events.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from art_core.errors import ArtError, ConfigError

__all__ = ["DEMONSTRATION_KEY", "TEACHER_KEY", "Teacher", "TeacherError", "as_teacher"]

DEMONSTRATION_KEY = "demonstration"
"""``Trajectory.metadata`` key set to True on a trajectory whose replies a teacher wrote."""
TEACHER_KEY = "teacher"
"""``Trajectory.metadata`` key naming the teacher that wrote its replies."""


class TeacherError(ArtError):
    """The teacher could not be reached, or answered a call with an error (the message quotes it)."""


@dataclass(frozen=True, kw_only=True)
class Teacher:
    """The stronger model that answers the agent's calls in demonstration mode.

    Two kinds: an OpenAI-compatible server (``base_url`` given: its ``/chat/completions`` is called with httpx),
    or any model litellm knows (``base_url`` None: ``model`` is a litellm model string such as
    ``"openai/gpt-4.1"`` or ``"anthropic/claude-sonnet-4-5"``, keys from litellm's usual environment variables).

    Args:
        model: the teacher's model name at ``base_url``, or a litellm model string.
        base_url: an OpenAI-compatible API's base URL, ending before ``/chat/completions``
            (``"https://api.openai.com/v1"``, ``"http://localhost:8000/v1"``). Default: None (litellm).
        api_key: sent as ``Authorization: Bearer`` to ``base_url`` (or passed to litellm). Default: None
            (none sent; litellm reads its environment).
        params: request fields sent with every call, over the agent's own (e.g. ``{"max_completion_tokens":
            4096}`` for a reasoning model, whose hidden reasoning counts against the agent's small token limit,
            or ``{"temperature": 0}``). Default: none; the agent's sampling settings are sent as they are.
        timeout: seconds to wait for one answer. Default: 600 (a long answer from a slow hosted model).

    Raises:
        ConfigError: an argument is invalid.
    """

    model: str
    base_url: str | None = None
    api_key: str | None = field(default=None, repr=False)
    params: Mapping[str, Any] = field(default_factory=dict)
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"Teacher needs a model name, got {self.model!r}")
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"Teacher base_url is {self.base_url!r}: give an http(s) URL such as "
                              "'https://api.openai.com/v1', or leave it out to call a litellm model string")
        if not self.timeout > 0:
            raise ConfigError(f"Teacher timeout is {self.timeout}: give a positive number of seconds")
        reserved = {"model", "messages", "stream", "n"} & set(self.params)
        if reserved:
            raise ConfigError(f"Teacher params may not set {sorted(reserved)}: the proxy sets them per call")

    @property
    def label(self) -> str:
        """How errors and ``metadata["teacher"]`` name it: the model, and where it is served."""
        return f"{self.model} at {self.base_url}" if self.base_url else self.model


def as_teacher(teacher: Teacher | str) -> Teacher:
    """``teacher`` as a ``Teacher`` (a string is a litellm model string).

    Raises:
        ConfigError: neither a ``Teacher`` nor a non-empty string.
    """
    if isinstance(teacher, Teacher):
        return teacher
    if isinstance(teacher, str):
        return Teacher(model=teacher)
    raise ConfigError(f"teacher must be a Teacher(...) or a litellm model string such as 'openai/gpt-4.1', got "
                      f"{type(teacher).__name__}")
