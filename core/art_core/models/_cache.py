"""The model cache: where prepared base models live, and how each is built exactly once.

Layout, under ``cache_dir()``::

    models/
        <entry>/                  complete: renamed into place only after the build finished
            .art-complete         JSON written last, before the rename (what was built, from what)
        .<entry>.tmp-<random>/    a build in progress, or one a crash left behind
        .<entry>.lock             held while <entry> is being built

A build writes into the temporary sibling and renames it to ``<entry>`` in one step, so a reader
sees either nothing or the whole folder. Readers that find ``<entry>`` complete take no lock. A
builder takes the lock, looks again (another process may have finished meanwhile), removes what
crashed builds left behind, and only then builds. Leftovers never look complete: their names differ
from ``<entry>`` and they hold no ``.art-complete``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from filelock import FileLock, Timeout
from platformdirs import user_cache_dir

from ..errors import BaseModelNotFoundError

__all__ = ["COMPLETE_MARKER", "build_once", "cache_dir"]

_log = logging.getLogger(__name__)

#: File written last inside a cache entry; an entry without it is not trusted.
COMPLETE_MARKER = ".art-complete"

_CACHE_ENV = "ART_CACHE_DIR"
_LOCK_TIMEOUT_S = 30 * 60.0  # a conversion takes ~15 s on 2 cores; 30 min means the other process is stuck


def cache_dir() -> Path:
    """Return the folder art-core caches prepared models in.

    Returns:
        Path: ``$ART_CACHE_DIR`` when set and not empty, else the user cache folder for ``art-core``
        (``~/.cache/art-core`` on Linux). The folder may not exist yet; it is created on first use.
    """
    configured = os.environ.get(_CACHE_ENV, "")
    path = Path(configured).expanduser() if configured else Path(user_cache_dir("art-core"))
    return path.absolute()


def build_once(
    target: Path,
    build: Callable[[Path], None],
    *,
    info: Mapping[str, object] | None = None,
    lock_timeout_s: float = _LOCK_TIMEOUT_S,
) -> Path:
    """Return ``target``, building it first unless a complete build is already there.

    Safe across threads and processes: one caller builds, the others wait for the lock and then
    find the entry complete.

    Args:
        target (Path): the cache entry to produce, e.g. ``<cache>/models/smollm2-135m-instruct-1a2b3c``.
        build (Callable[[Path], None]): writes the entry's files into the empty folder it is given.
        info (Mapping[str, object] | None): JSON-serialisable facts recorded in ``.art-complete``.
            Default: none.
        lock_timeout_s (float): how long to wait for another builder of the same entry. Default: 30 min.

    Returns:
        Path: ``target``, complete.

    Raises:
        BaseModelNotFoundError: another process held the build lock for longer than ``lock_timeout_s``.
        Exception: whatever ``build`` raised; its temporary folder is removed first.
    """
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    lock = FileLock(lock_path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _log.info("waiting for another process to finish building %s (lock %s)", target, lock_path)
        try:
            lock.acquire(timeout=lock_timeout_s)
        except Timeout as exc:
            raise BaseModelNotFoundError(
                f"waited {lock_timeout_s:g} s for another process building {target} (lock file {lock_path}); "
                "stop that process if it is stuck, or wait and retry"
            ) from exc
    try:
        if _is_complete(target):  # another process built it while we waited
            return target
        _remove_leftovers(target)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(staging)
            marker = {"built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(info or {})}
            (staging / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            staging.chmod(0o755)  # mkdtemp made it private; the cache may be shared by several users
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return target
    finally:
        lock.release()


def _is_complete(target: Path) -> bool:
    return (target / COMPLETE_MARKER).is_file()


def _remove_leftovers(target: Path) -> None:
    # Called with the lock held: no live builder of this entry exists, so every temporary folder
    # is a crashed build's, and a target without its marker was not made by build_once.
    for leftover in target.parent.glob(f".{target.name}.tmp-*"):
        _log.info("removing %s, left by an interrupted build", leftover)
        shutil.rmtree(leftover, ignore_errors=True)
    if target.exists():
        _log.warning("removing %s: it has no %s, so it is not a finished build", target, COMPLETE_MARKER)
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink()
