"""Warnings attributed to the user's line, not to ours: ``warn_at_caller``."""

from __future__ import annotations

import sys
import warnings

__all__ = ["warn_at_caller"]

_LIBRARY = ("art_core", "art_plugins", "asyncio")


def warn_at_caller(warning: Warning) -> None:
    """``warnings.warn(warning)`` attributed to the first frame outside art_core, art_plugins and asyncio: the
    user's line (``await model.train(...)``), not ours, so the console shows the call that caused it."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _LIBRARY:
        frame, level = frame.f_back, level + 1
    warnings.warn(warning, stacklevel=level if frame is not None else 2)
