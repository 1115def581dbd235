"""The name tables of the backends: the models a backend has registered (``ModelTable``), and the choices a
backend is built from by name (``choose``: ``inference=``, ``trainer=``). Light on purpose: ``RemoteBackend``
uses it without torch."""

from __future__ import annotations

from pathlib import Path
from typing import Generic, TypeVar

from .._paths import folder_problem
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

    def check_folder(self, model: ModelSpec) -> None:
        """Say, before anything is loaded, why the model's folder could not be made, and what to give instead.
        Nothing is created here: a registration that fails later leaves no folder behind."""
        folder = self.folder(model)
        problem = folder_problem(folder)
        if problem:
            raise ConfigError(f"{self.owner}(path={str(self.path)!r}) cannot make the folder of model {model.name!r}, "
                              f"{folder}: {problem}; give path= a folder this process can write, or one it can create")

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
