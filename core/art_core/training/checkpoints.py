"""Numbered checkpoints in PEFT adapter format, written atomically.

Layout: ``<model_dir>/checkpoints/NNNN/`` holds ``adapter_model.safetensors``, ``adapter_config.json``,
``optimizer.pt`` (to resume training where it stopped) and ``checkpoint.json``, written last. A checkpoint
is written into a hidden temporary sibling and renamed into place, so a crash leaves either the old set
of checkpoints or the new one (the hidden leftover is removed when the model is next loaded); a numbered folder
without ``checkpoint.json`` (copied by hand, or written by other tools) is ignored with a warning. A step run for
``art-core serve``'s train call names the call in ``checkpoint.json``, with the step's metrics.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from ..config import LoraSettings

__all__ = ["CheckpointInfo", "check_adapter_shape", "checkpoint_of_train_call", "delete_checkpoints",
           "latest_checkpoint", "list_checkpoints", "remove_interrupted_writes", "write_checkpoint"]

MARKER = "checkpoint.json"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path


def checkpoint_dir(model_dir: Path, step: int) -> Path:
    return model_dir / "checkpoints" / f"{step:04d}"


def write_checkpoint(model_dir: Path, step: int, save: Any, *, metadata: dict[str, Any]) -> Path:
    """Write checkpoint ``step`` atomically.

    Args:
        model_dir: ``<root>/<project>/models/<name>``.
        step: the step number (1 = after the first training step).
        save: a function taking a directory and writing the adapter (and optimizer) files into it.
        metadata: written to ``checkpoint.json`` with the step and time.

    Returns:
        The checkpoint's directory.
    """
    final = checkpoint_dir(model_dir, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{step:04d}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save(tmp)
        (tmp / MARKER).write_text(json.dumps({"step": step, "time": time.time(), **metadata}, indent=2))
        if final.exists():
            # Same step written again (a retried step): keep the older one until the new one is complete.
            stale = final.parent / f".old-{step:04d}-{uuid.uuid4().hex[:8]}"
            final.rename(stale)
            tmp.rename(final)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def list_checkpoints(model_dir: Path) -> list[CheckpointInfo]:
    """Complete checkpoints, oldest first. Incomplete ones are skipped with a warning."""
    root = model_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            continue  # temporary folders of a write in progress or interrupted
        if not (entry.is_dir() and entry.name.isdigit()):
            continue
        if not (entry / MARKER).is_file() or not (entry / "adapter_config.json").is_file():
            warnings.warn(
                f"ignoring incomplete checkpoint {entry} (no {MARKER} or adapter_config.json): it was "
                "probably interrupted while being written; delete it to silence this warning",
                stacklevel=2,
            )
            continue
        found.append(CheckpointInfo(step=int(entry.name), path=entry))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(model_dir: Path) -> CheckpointInfo | None:
    """The complete checkpoint with the highest step, or None."""
    checkpoints = list_checkpoints(model_dir)
    return checkpoints[-1] if checkpoints else None


def check_adapter_shape(checkpoint: Path, lora: LoraSettings, *, model: str) -> None:
    """Raise when ``lora`` asks for another adapter shape than ``checkpoint`` holds.

    A model's adapter is fixed for its life: resumed with other settings, the checkpoint would load as it was
    saved and the settings would be silently ignored (and recorded as if they held).

    Raises:
        ConfigError: rank, alpha, dropout or target modules differ; the message names both and the fix.
    """
    try:
        saved = json.loads((checkpoint / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # not ours to judge: loading it will say what is wrong
    pairs = {"rank": (saved.get("r"), lora.rank), "alpha": (saved.get("lora_alpha"), lora.alpha),
             "dropout": (saved.get("lora_dropout"), lora.dropout),
             "target_modules": (sorted(saved.get("target_modules") or []), sorted(lora.target_modules))}
    differ = {name: pair for name, pair in pairs.items() if pair[0] is not None and pair[0] != pair[1]}
    if differ:
        said = ", ".join(f"{name} {theirs!r} (asked: {ours!r})" for name, (theirs, ours) in differ.items())
        raise ConfigError(f"model {model!r} resumes from {checkpoint}, whose adapter has {said}: an adapter's shape "
                          "is fixed for the model's life; register it with the checkpoint's LoraSettings, or train "
                          "a model of another name")


def remove_interrupted_writes(model_dir: Path) -> list[str]:
    """Delete the hidden folders a killed process left in ``checkpoints/`` (``.tmp-``: a write never renamed into
    place; ``.old-``/``.del-``: a replaced or deleted checkpoint not yet removed). Returns their names.

    Only safe while no process writes the model's checkpoints: the backends call it when they load a model,
    before its first step.
    """
    root = model_dir / "checkpoints"
    removed = []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        if entry.is_dir() and entry.name.startswith((".tmp-", ".old-", ".del-")):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed


def checkpoint_of_train_call(model_dir: Path, train_id: str) -> tuple[int, dict[str, Any]] | None:
    """``(step, metrics)`` of the checkpoint a train call wrote (``train_id`` in its ``checkpoint.json``), newest
    first; None when no checkpoint names it. How a call resent after a crash (checkpoint written, result not
    yet recorded) is answered rather than trained again."""
    for info in list_checkpoints(model_dir)[:-4:-1]:  # the newest three: a crash leaves at most the last unrecorded
        try:
            data = json.loads((info.path / MARKER).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if data.get("train_id") == train_id and isinstance(data.get("metrics"), dict):
            return info.step, data["metrics"]
    return None


def delete_checkpoints(model_dir: Path, steps: Iterable[int], *, keep: int) -> list[int]:
    """Delete the complete checkpoints numbered ``steps``, except ``keep`` (the one being served).

    Each is renamed to a hidden folder first, so a crash mid-delete never leaves a numbered folder that
    looks complete but is not. Steps with no checkpoint are ignored.

    Returns:
        The steps deleted, ascending.

    Raises:
        CheckpointError: ``steps`` names ``keep``.
    """
    wanted = set(steps)
    if keep in wanted:
        raise CheckpointError(f"checkpoint {keep:04d} is the one being served and cannot be deleted; "
                              "train another step first, or leave it out of the list")
    deleted = []
    for info in list_checkpoints(model_dir):
        if info.step in wanted:
            doomed = info.path.parent / f".del-{info.step:04d}-{uuid.uuid4().hex[:8]}"
            info.path.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            deleted.append(info.step)
    return deleted
