"""Why a folder could not be made, found before any work that would be lost when making it fails."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["folder_problem"]


def folder_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot be made (or written into) by this process, e.g. ``"/etc/passwd is a file"``;
    None when it can. Nothing is created."""
    existing = folder
    while not existing.exists():  # False under a file too: look for the nearest existing parent
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this process"
    return None
