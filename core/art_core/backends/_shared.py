"""What every in-process backend (``LocalBackend``, ``RayBackend``) does the same way.

- ``sample``: the chat is rendered through the gateway's message conversion (``art_core.messages``), so a
  conversation gives the same prompt tokens whichever way it reaches the model, and each reply becomes a
  trajectory with its token-exact call record.
- The on-disk layout under ``<model_dir>``: ``trajectories/NNNN.jsonl`` (never overwritten) and ``history.jsonl``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..engines.base import EngineOutput
from ..messages import template_messages
from ..types import CallRecord, Message, Trajectory

__all__ = ["append_history", "read_history", "render_chat", "sampled_trajectories", "trajectories_path"]


def render_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """The prompt token ids of ``messages`` (and ``tools``), ready for the assistant's turn."""
    prompt = tokenizer.apply_chat_template(template_messages(list(messages)), tools=tools, add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    return list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)


def sampled_trajectories(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None,
                         prompt: list[int], completions: Sequence[EngineOutput]) -> list[Trajectory]:
    """One trajectory per completion: the chat, the reply, and the call's token-exact record."""
    chat = [Message.model_validate(m) for m in messages]
    return [Trajectory(
        messages=[*chat, Message(role="assistant", content=tokenizer.decode(c.token_ids, skip_special_tokens=True))],
        tools=tools or [],
        calls=[CallRecord(prompt_token_ids=prompt, completion_token_ids=c.token_ids, logprobs=c.logprobs,
                          adapter_step=c.adapter_step, finish_reason=c.finish_reason)],
    ) for c in completions]


def trajectories_path(model_dir: Path, step: int) -> Path:
    """``trajectories/NNNN.jsonl``, or ``NNNN-2.jsonl``... when an earlier attempt at the same step left one."""
    folder, stem = model_dir / "trajectories", f"{step:04d}"
    path, k = folder / f"{stem}.jsonl", 2
    while path.exists():
        path, k = folder / f"{stem}-{k}.jsonl", k + 1
    return path


def read_history(model_dir: Path) -> list[dict[str, Any]]:
    """The rows of ``history.jsonl`` (empty when no step was run)."""
    path = model_dir / "history.jsonl"
    if not path.is_file():
        return []
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def append_history(model_dir: Path, row: dict[str, Any]) -> None:
    """Append one step's row to ``history.jsonl``."""
    model_dir.mkdir(parents=True, exist_ok=True)
    with (model_dir / "history.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps(row, default=float) + "\n")
