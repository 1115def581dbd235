"""The judge's answers on disk, keyed by a hash of everything that decides them, so a re-run costs nothing.

Layout, under the cache folder (default ``$ART_CACHE_DIR/ruler``, i.e. ``~/.cache/art-core/ruler``)::

    ab/abcdef....json   one checked answer: {"key": ..., "judgements": {...}, "usage": {...}}

A key is the SHA-256 of canonical JSON: the judge model, the rubric, the order seed, the exact messages
and answer schema sent, and the extra completion arguments. The API base and key are left out: the same
judge behind another address or key gives the same answer. Entries are written to a temporary file and
renamed, so a reader never sees half of one; an unreadable entry is a miss (and is overwritten).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from ._answer import Judgement

__all__ = ["JudgeCache", "cache_key", "default_cache_dir"]

logger = logging.getLogger(__name__)

CACHE_VERSION = 1
"""Bumped when what a key covers, or what an entry holds, changes: old entries then simply miss."""


def default_cache_dir() -> Path:
    """``$ART_CACHE_DIR/ruler`` (default ``~/.cache/art-core/ruler``)."""
    from ..models._cache import cache_dir

    return cache_dir() / "ruler"


def cache_key(payload: dict[str, Any]) -> str:
    """SHA-256 hex digest of ``payload`` as canonical JSON (sorted keys; unknown objects by ``repr``)."""
    text = json.dumps({"version": CACHE_VERSION, **payload}, sort_keys=True, ensure_ascii=False,
                      separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class JudgeCache:
    """Checked judge answers in a folder, one JSON file per key."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)

    def get(self, key: str) -> dict[str, Judgement] | None:
        """The answer stored under ``key``, or None (missing or unreadable)."""
        path = self._path(key)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return {label: Judgement(float(j["score"]), str(j["explanation"]),
                                     tuple(j["step_scores"]) if j.get("step_scores") is not None else None)
                    for label, j in data["judgements"].items()}
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring unreadable RULER cache entry %s: %s", path, exc)
            return None

    def put(self, key: str, judgements: dict[str, Judgement], usage: dict[str, Any]) -> None:
        """Store ``judgements`` under ``key`` (atomically: temporary file, then rename). A cache that cannot be
        written (a read-only or full disk) is warned about, never raised: the answer in hand is kept."""
        try:
            self._write(key, judgements, usage)
        except OSError as exc:
            logger.warning("could not write the RULER cache entry under %s (%s): the answer is used but not "
                           "cached; pass cache_dir= a writable folder, or cache_dir=None", self.folder, exc)

    def _write(self, key: str, judgements: dict[str, Judgement], usage: dict[str, Any]) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        entry = {
            "key": key,
            "judgements": {label: {"score": j.score, "explanation": j.explanation,
                                   "step_scores": list(j.step_scores) if j.step_scores is not None else None}
                           for label, j in judgements.items()},
            "usage": usage,  # what the original call cost, for the curious; a hit costs nothing
        }
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:12]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(entry, f, ensure_ascii=False)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _path(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}.json"
