"""The rule for model and project names, which become folder names (and model names in URLs)."""

from __future__ import annotations

import re

from .errors import ConfigError

__all__ = ["check_name"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_name(kind: str, value: str) -> str:
    """``value`` if it can name a folder under the backend's root, else a ConfigError naming ``kind``.

    No separators, no "..": 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit.
    """
    if not _NAME.match(value) or ".." in value:
        raise ConfigError(f"{kind} {value!r} is not allowed: use 1-64 letters, digits, '.', '_' or '-', "
                          "starting with a letter or digit")
    return value
