"""What an adapter's ``langfuse=`` option means: which ``LangfuseTracing`` traces its rollouts (None: off).

``True`` means one tracing per process, built from the ``LANGFUSE_*`` environment variables; a ``Langfuse``
client means one tracing per client; a ``LangfuseTracing`` means itself. Those choices are kept in one
``LangfuseOptions`` object (``OPTIONS``), never in module globals. This module imports neither the Langfuse SDK
nor the rest of the Langfuse layer until an option turns Langfuse on: off, the adapters load nothing of it.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

from art_core import TrainableModel
from art_core.errors import ConfigError

from ._tracing import Tracer

if TYPE_CHECKING:
    from ._langfuse_traces import LangfuseTracing

__all__ = ["OPTIONS", "LangfuseOptions", "langfuse_tracers", "resolve"]


class LangfuseOptions:
    """The tracings ``langfuse=`` options resolved to: one for ``True``, one per ``Langfuse`` client."""

    def __init__(self) -> None:
        self.default: LangfuseTracing | None = None
        """The tracing ``langfuse=True`` means (made at its first use; made again once closed)."""
        self._by_client: weakref.WeakKeyDictionary[Any, LangfuseTracing] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def resolve(self, option: Any, model: TrainableModel) -> LangfuseTracing | None:
        """The ``LangfuseTracing`` an adapter's ``langfuse=`` option means (None: off), attached to ``model``.

        Raises:
            ConfigError: the option is not one of False/None, True, a ``Langfuse`` client or a ``LangfuseTracing``;
                or it is True and the environment lacks the keys.
        """
        if option is None or option is False:
            return None
        from ._langfuse_traces import LangfuseTracing  # first: its ImportError names the extra to install

        from langfuse import Langfuse

        with self._lock:
            if option is True:
                if self.default is None or self.default.closed:
                    self.default = LangfuseTracing()
                tracing = self.default
            elif isinstance(option, LangfuseTracing):
                tracing = option
            elif isinstance(option, Langfuse):
                tracing = self._by_client.get(option)
                if tracing is None or tracing.closed:
                    tracing = self._by_client[option] = LangfuseTracing(option)
            else:
                raise ConfigError(f"langfuse= takes True, False, a langfuse.Langfuse client or a LangfuseTracing, "
                                  f"got {type(option).__name__}")
        tracing.attach(model)
        return tracing


OPTIONS = LangfuseOptions()
"""The process's resolved options (``langfuse=True`` keeps one tracing per process)."""


def resolve(option: Any, model: TrainableModel) -> LangfuseTracing | None:
    """``OPTIONS.resolve(option, model)``."""
    return OPTIONS.resolve(option, model)


def langfuse_tracers(option: Any, model: TrainableModel) -> tuple[Tracer, ...]:
    """The tracers an adapter's ``langfuse=`` option adds to its rollouts (none when off), checked now (and the
    model's steps traced), not at the first rollout.

    Raises:
        ConfigError: as ``resolve``.
    """
    tracing = resolve(option, model) if option else None
    return (tracing,) if tracing is not None else ()
