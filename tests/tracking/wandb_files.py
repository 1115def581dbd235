"""Reads the records of a W&B offline run from the ``run-<id>.wandb`` file the W&B SDK wrote.

wandb 0.31 no longer ships a Python reader for these files (its Go core writes and syncs them), so this reads
the file's framing directly: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then LevelDB-log-format
blocks of 32 KiB, each record a chunk header (CRC32, length, type: full/first/middle/last) and its bytes.
Each whole record is one of wandb's own protobuf ``Record`` messages (``wandb.proto.wandb_internal_pb2``).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

_BLOCK = 32 * 1024
_CHUNK_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    """Every ``Record`` in the file, in order."""
    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    if (ident, magic, version) != (b":W&B", 0xBEE1, 0):
        raise ValueError(f"{path} is not a W&B run file (header {data[:7]!r})")
    out, pending, pos = [], b"", 7
    while pos + _CHUNK_HEADER <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _CHUNK_HEADER:  # the block's tail is padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _CHUNK_HEADER])
        chunk = data[pos + _CHUNK_HEADER:pos + _CHUNK_HEADER + length]
        pos += _CHUNK_HEADER + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def history(path: Path) -> list[dict[str, Any]]:
    """The run's logged rows (``run.log``), values decoded from JSON; ``_step`` is the step."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                if item.key:
                    row[item.key] = json.loads(item.value_json)
                    continue
                *parents, leaf = item.nested_key  # a logged object (a table) is flattened into nested keys
                node = row
                for parent in parents:
                    node = node.setdefault(parent, {})
                node[leaf] = json.loads(item.value_json)
            rows.append(row)
    return rows


def run_ids(path: Path) -> list[str]:
    """The run ids the file's run records name."""
    return [r.run.run_id for r in records(path) if r.WhichOneof("record_type") == "run"]


def config(path: Path) -> dict[str, Any]:
    """The run's config as its config records left it (later updates win)."""
    out: dict[str, Any] = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "config":
            for item in record.config.update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out
