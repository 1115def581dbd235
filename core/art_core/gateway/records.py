"""What the gateway remembers of each answered call: one ``ExchangeRecord`` per choice, token-exact.

Records are the trainer's source of truth: the exact prompt token ids the engine saw, the ids it sampled
and their log-probabilities, and which adapter sampled them. ``RecordStore`` appends each record to a
JSONL file (and flushes it; fsyncs it too with ``fsync=True``) before the response goes out, so a crash
of the process never loses a call a client was answered for, and keeps a bounded in-memory index by rollout for fast look-up.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import ConfigError
from ..types import CallRecord

__all__ = ["ExchangeRecord", "RecordStore"]

logger = logging.getLogger(__name__)


class ExchangeRecord(BaseModel):
    """One answered choice of one request, as the engine saw and produced it."""

    # -Infinity stays -Infinity in the file (pydantic's default writes null, which would not read back).
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")

    request_id: str
    """The response's id (``chatcmpl-...``); the ``n`` choices of one request share it."""
    choice_index: int = Field(0, ge=0)
    """Which of the request's ``n`` choices this is (one record per choice)."""
    rollout_id: str | None = None
    """Rollout the call belongs to (URL prefix ``/rollouts/{id}`` or ``X-Rollout-Id``); None outside rollouts."""
    created: float = Field(default_factory=time.time)
    """Unix time the request arrived."""
    endpoint: Literal["chat.completions", "responses"] = "chat.completions"
    """The API the call came through."""
    model: str
    """The model name as the client requested it."""
    adapter_step: int
    """Checkpoint step of the adapter that sampled the completion (0: the base model)."""
    request: dict[str, Any]
    """The request body as received (messages, tools and parameters), JSON."""
    prompt_token_ids: list[int]
    """The rendered chat template the engine ran, as token ids."""
    completion_token_ids: list[int]
    """Sampled ids, including the end-of-turn token when generation stopped on it."""
    logprobs: list[float]
    """The sampler's log-probability of each completion token (same length as ``completion_token_ids``)."""
    finish_reason: str
    """As returned to the client: ``stop``, ``length`` or ``tool_calls``; ``cancelled`` when the call was
    stopped before its end (the client went away, the rollout's timeout): the ids are those sampled so far."""
    timings: dict[str, float] = Field(default_factory=dict)
    """Seconds: ``wait`` (held while paused), ``queue`` (engine called -> first token: queued and prefill),
    ``generate`` (first token -> last), ``total`` (request)."""
    messages: list[dict[str, Any]] = Field(default_factory=list)
    """The conversation in chat-completions format, as rendered into the prompt (a Responses request's
    input items converted): what a trajectory is rebuilt from, whichever endpoint the call used."""
    tools: list[dict[str, Any]] = Field(default_factory=list)
    """Chat-format function-tool schemas the prompt offered (empty when none, or ``tool_choice="none"``)."""
    reply: dict[str, Any] = Field(default_factory=dict)
    """The assistant message as answered: ``role``, ``content`` and ``tool_calls`` with the ids the client got."""
    caller: str | None = None
    """Which part of the agent made the call (``X-Art-Caller`` header: a graph node, an agent's name)."""

    def to_call_record(self) -> CallRecord:
        """The token-exact part a ``Trajectory`` carries in ``calls`` (``request_id`` links back here)."""
        return CallRecord(
            prompt_token_ids=self.prompt_token_ids,
            completion_token_ids=self.completion_token_ids,
            logprobs=self.logprobs,
            adapter_step=self.adapter_step,
            finish_reason=self.finish_reason,
            request_id=self.request_id,
            rollout_id=self.rollout_id,
            caller=self.caller,
        )


class RecordStore:
    """Appends records to a JSONL file and keeps the latest ``max_in_memory`` indexed by rollout.

    Safe to call from several threads and tasks: one lock guards the file and the index. ``add`` writes
    synchronously (a short append and flush), which is what makes "answered means recorded" hold.

    Args:
        path: JSONL file to append to (created with its folders); None keeps records in memory only.
        max_in_memory: records kept in the index; the oldest are evicted first. Default: 10 000.
        fsync: also ``os.fsync`` each record before the response goes out, so a power cut or kernel
            crash loses nothing answered either. Default: False (a flush survives a process crash; an
            fsync costs ~0.1-10 ms per record depending on the disk, paid inside every request).
    """

    def __init__(self, path: Path | None = None, *, max_in_memory: int = 10_000, fsync: bool = False) -> None:
        if max_in_memory < 1:
            raise ConfigError(f"max_in_memory is {max_in_memory}: keep at least 1 record in memory")
        self.path = Path(path) if path is not None else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_in_memory = max_in_memory
        self.fsync = fsync
        self._lock = threading.Lock()
        self._records: OrderedDict[int, ExchangeRecord] = OrderedDict()  # insertion number -> record
        self._by_rollout: dict[str | None, list[int]] = {}
        self._evicted_rollouts: set[str | None] = set()  # rollouts whose older records live only in the file
        self._count = 0

    def __len__(self) -> int:
        """Records added since the store was created (evicted ones included)."""
        return self._count

    def add(self, record: ExchangeRecord) -> None:
        """Append ``record`` to the file (flushed) and to the index."""
        line = record.model_dump_json() + "\n" if self.path is not None else ""  # serialised only to be written
        with self._lock:
            if self.path is not None:
                # Flushed to the OS before the client is answered: a process crash loses nothing answered.
                # Without fsync a power cut may still lose the last lines; with it, nothing answered is lost.
                with self.path.open("a", encoding="utf-8") as f:
                    f.write(line)
                    f.flush()
                    if self.fsync:
                        os.fsync(f.fileno())
            key = self._count
            self._count += 1
            self._records[key] = record
            self._by_rollout.setdefault(record.rollout_id, []).append(key)
            while len(self._records) > self.max_in_memory:
                self._evict_oldest()

    def for_rollout(self, rollout_id: str | None) -> list[ExchangeRecord]:
        """Records of one rollout (``None``: calls made outside any rollout), oldest first.

        Records evicted from memory are read back from the file when there is one.
        """
        with self._lock:
            in_memory = [self._records[key] for key in self._by_rollout.get(rollout_id, [])]
            if rollout_id not in self._evicted_rollouts or self.path is None:
                return in_memory
            return self._scan_file(rollout_id)

    def _evict_oldest(self) -> None:
        key, record = self._records.popitem(last=False)
        keys = self._by_rollout[record.rollout_id]
        keys.remove(key)  # the oldest key of its rollout, so this is keys[0]: O(1) in practice
        if not keys:
            del self._by_rollout[record.rollout_id]
        self._evicted_rollouts.add(record.rollout_id)

    def _scan_file(self, rollout_id: str | None) -> list[ExchangeRecord]:
        assert self.path is not None  # callers check
        found = []
        with self.path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    data = json.loads(line)
                except ValueError:  # a line cut short by a crash mid-write: say so, keep the rest
                    logger.warning("%s:%d is not valid JSON; skipped", self.path, lineno)
                    continue
                if data.get("rollout_id") == rollout_id:
                    found.append(ExchangeRecord.model_validate(data))
        return found
