"""The name tables of the backends: the models a backend has registered (``ModelTable``), and the choices a
backend is built from by name (``choose``: ``inference=``, ``trainer=``). Light on purpose: ``RemoteBackend``
uses it without torch."""

from __future__ import annotations

from pathlib import Path
from typing import Generic, TypeVar

from ..errors import ConfigError, LifecycleError, ModelNotRegisteredError
from .base import ModelSpec

__all__ = ["ModelTable", "choose"]

T = TypeVar("T")


def choose(table: dict[str, T], name: str, what: str) -> T:
    """The entry of ``table`` named ``name``.

    Raises:
        ConfigError: no entry has that name (the message names ``what`` and lists the known ones).
    """
    try:
        return table[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown {what} {name!r}: choose one of {sorted(table)}") from None


S = TypeVar("S")


class ModelTable(Generic[S]):
    """A backend's registered models and their folders under ``path``; refuses use after ``close``.

    Args:
        path: the root folder of projects.
        owner: the backend's class name, for messages.
    """

    def __init__(self, path: Path, owner: str) -> None:
        self.path, self.owner = path, owner
        self.slots: dict[tuple[str, str], S] = {}
        self.closed = False

    def folder(self, model: ModelSpec) -> Path:
        """``<path>/<project>/models/<name>``."""
        return self.path / model.project / "models" / model.name

    def make_folder(self, model: ModelSpec) -> Path:
        """Make the model's folder, or say why it cannot be made (before anything is loaded) and what to give."""
        folder = self.folder(model)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"{self.owner}(path={str(self.path)!r}) cannot make the folder of model "
                              f"{model.name!r}, {folder} ({type(exc).__name__}: {exc.strerror or exc}): give path= "
                              "a folder this process can write, or one it can create") from exc
        return folder

    def check_open(self) -> None:
        if self.closed:
            raise LifecycleError(f"this {self.owner} is closed; create a new one")

    def check_new(self, model: ModelSpec) -> None:
        """Raise unless the backend is open and the model is not registered yet."""
        self.check_open()
        if (model.project, model.name) in self.slots:
            raise LifecycleError(f"a model named {model.name!r} in project {model.project!r} is already "
                                 "registered with this backend")

    def add(self, model: ModelSpec, slot: S) -> None:
        self.slots[(model.project, model.name)] = slot

    def get(self, model: ModelSpec) -> S:
        self.check_open()
        slot = self.slots.get((model.project, model.name))
        if slot is None:
            raise ModelNotRegisteredError(f"model {model.name!r} is not registered with this backend")
        return slot

    def close(self) -> list[S]:
        """Mark the backend closed; returns the slots to release."""
        self.closed = True
        slots = list(self.slots.values())
        self.slots.clear()
        return slots
