"""RecordStore: one JSON line per record, flushed; a bounded index by rollout; token-exact CallRecords."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from art_core.gateway import ExchangeRecord, RecordStore
from art_core.types import CallRecord


def record(i: int, rollout: str | None = "r1") -> ExchangeRecord:
    return ExchangeRecord(
        request_id=f"chatcmpl-{i}", rollout_id=rollout, model="agent", adapter_step=2, request={"i": i},
        prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5, 2], logprobs=[-0.1, -0.2, -0.3], finish_reason="stop",
    )


def test_add_appends_one_line_each(tmp_path: Path):
    path = tmp_path / "sub" / "records.jsonl"
    store = RecordStore(path)
    store.add(record(0))
    store.add(record(1, rollout=None))
    lines = path.read_text().splitlines()
    assert [json.loads(line)["request_id"] for line in lines] == ["chatcmpl-0", "chatcmpl-1"]
    written = ExchangeRecord.model_validate_json(lines[0])
    assert written == record(0).model_copy(update={"created": written.created})
    assert [r.request_id for r in store.for_rollout("r1")] == ["chatcmpl-0"]
    assert [r.request_id for r in store.for_rollout(None)] == ["chatcmpl-1"]
    assert store.for_rollout("other") == [] and len(store) == 2


def test_eviction_keeps_memory_bounded_and_reads_back_from_the_file(tmp_path: Path):
    store = RecordStore(tmp_path / "r.jsonl", max_in_memory=3)
    for i in range(5):
        store.add(record(i, rollout="a" if i % 2 == 0 else "b"))
    assert len(store._records) == 3  # noqa: SLF001  (the bound itself is what is tested)
    assert [r.request_id for r in store.for_rollout("a")] == ["chatcmpl-0", "chatcmpl-2", "chatcmpl-4"]
    assert [r.request_id for r in store.for_rollout("b")] == ["chatcmpl-1", "chatcmpl-3"]
    memory_only = RecordStore(None, max_in_memory=2)
    for i in range(3):
        memory_only.add(record(i))
    assert [r.request_id for r in memory_only.for_rollout("r1")] == ["chatcmpl-1", "chatcmpl-2"]


def test_to_call_record_is_token_exact():
    call = record(7).to_call_record()
    assert isinstance(call, CallRecord)
    assert (call.prompt_token_ids, call.completion_token_ids) == ([1, 2, 3], [4, 5, 2])
    assert call.logprobs == [-0.1, -0.2, -0.3]
    assert (call.adapter_step, call.finish_reason, call.request_id, call.rollout_id) == (2, "stop", "chatcmpl-7", "r1")


def test_threads_can_add_concurrently(tmp_path: Path):
    store = RecordStore(tmp_path / "r.jsonl", max_in_memory=50)
    threads = [threading.Thread(target=lambda k=k: [store.add(record(k * 100 + i, rollout=f"t{k}")) for i in range(25)])
               for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert len(lines) == 100 and all(json.loads(line) for line in lines)
    assert all(len(store.for_rollout(f"t{k}")) == 25 for k in range(4))


def test_fsync_records_syncs_each_line_to_disk(tmp_path: Path, monkeypatch, tokenizer):
    import os

    from art_core.gateway import GatewaySettings
    from art_core.gateway.app import create_app

    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    RecordStore(tmp_path / "off.jsonl").add(record(0))
    assert synced == []  # the default: flushed, not fsynced
    store = RecordStore(tmp_path / "on.jsonl", fsync=True)
    store.add(record(0))
    store.add(record(1))
    assert len(synced) == 2 and len((tmp_path / "on.jsonl").read_text().splitlines()) == 2

    from fakes import FakeEngine

    app = create_app(FakeEngine(tokenizer), GatewaySettings(records_path=tmp_path / "s.jsonl", fsync_records=True))
    assert app.state.gateway.records.fsync is True
