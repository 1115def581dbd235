"""Who may use a module that a trainer and an in-process engine share, and torch's thread count, scoped.

With ``LocalBackend(inference="transformers", trainer="peft")`` on one device, the transformers engine decodes
the trainer's own PEFT module, so a step needs no adapter reload. A training step changes that module in ways a
decode cannot run beside: it flips ``train()``/``eval()``, gives layers instance ``forward``s for a block (fused
LoRA, lean MLPs), switches ``config._attn_implementation``, and its optimizer step rewrites the adapter's
weights under the engine's packed copies and prompt cache (``engines/_packed.py``). So the module has one user
at a time, and that is checked here rather than left to convention:

    with module_ownership(model).training():      # the trainer: refused while an engine of the module serves
        ...                                         # (is not paused) or decodes
    with module_ownership(model).decoding():      # the engine's decode loop: refused while the trainer holds it
        ...
    module_ownership(model).engine_serving(engine, True)   # the engine says whether it admits requests

The ownership object belongs to the module (one per module, found by identity), so every layout that shares a
module shares its ownership, and a layout that does not (an engine with its own copy) never contends. A layout
that cannot serve while training therefore says so, with an error naming the fix, instead of corrupting a decode.

``torch_threads(n)`` sets torch's thread count for a block and restores it after, also when blocks of several
threads overlap (two models stepping at once): the count a thread had before its first block comes back.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .errors import EngineError, TrainingError

__all__ = ["ModuleOwnership", "module_ownership", "torch_threads"]


class ModuleOwnership:
    """Who uses one module now: nobody, the trainer (one step), or the engine's decode loops.

    Also tracks which engines of the module serve (admit requests) rather than being paused: the trainer
    may take the module only when none does, so no request can reach a decode mid-step.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._training = False
        self._decoding = 0  # decode loops running on the module now
        self._serving: weakref.WeakSet[Any] = weakref.WeakSet()  # engines that admit requests (not paused)

    def __repr__(self) -> str:
        state = "training" if self._training else f"decoding x{self._decoding}" if self._decoding else "free"
        return f"ModuleOwnership({state}, serving engines={len(self._serving)})"

    @property
    def holder(self) -> str | None:
        """``"trainer"``, ``"engine"`` or None (free)."""
        return "trainer" if self._training else "engine" if self._decoding else None

    def engine_serving(self, engine: Any, serving: bool) -> None:
        """Record whether ``engine`` (one decoding this module) admits requests (True) or is paused or closed."""
        with self._lock:
            if serving:
                self._serving.add(engine)
            else:
                self._serving.discard(engine)

    @contextmanager
    def training(self) -> Iterator[None]:
        """Hold the module for a training step.

        Raises:
            TrainingError: an engine of this module decodes now, or serves (is not paused), or another step holds
                the module. The message names the fix.
        """
        with self._lock:
            if self._training:
                raise TrainingError("another training step holds this module: run one step at a time per model")
            if self._decoding or self._serving:
                what = "is decoding on" if self._decoding else "serves (is not paused) from"
                raise TrainingError(f"an in-process engine {what} the module this step would train: pause the "
                                    "engine (await engine.pause()) before the step and resume it after "
                                    "(LocalBackend.train does both)")
            self._training = True
        try:
            yield
        finally:
            with self._lock:
                self._training = False

    @contextmanager
    def decoding(self) -> Iterator[None]:
        """Hold the module for a decode loop (several loops may hold it at once).

        Raises:
            EngineError: a training step holds the module.
        """
        with self._lock:
            if self._training:
                raise EngineError("a training step holds the module this engine decodes (they share one PEFT "
                                  "model): the engine must be paused for the step and resumed after it, as "
                                  "LocalBackend.train does; nothing was decoded")
            self._decoding += 1
        try:
            yield
        finally:
            with self._lock:
                self._decoding -= 1


_OWNERS: weakref.WeakKeyDictionary[Any, ModuleOwnership] = weakref.WeakKeyDictionary()
_OWNERS_LOCK = threading.Lock()


def module_ownership(module: Any) -> ModuleOwnership:
    """The ownership of ``module`` (made on first use, kept as long as the module lives)."""
    with _OWNERS_LOCK:
        owner = _OWNERS.get(module)
        if owner is None:
            owner = _OWNERS[module] = ModuleOwnership()
        return owner


_threads_lock = threading.Lock()
_threads_active = 0  # blocks inside torch_threads now, in every thread
_threads_original = 0  # the count before the first of them began
_threads_depth = threading.local()  # this thread's nesting of torch_threads blocks


@contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """Within the block, torch uses ``count`` threads (None: leave it); the previous count is restored after.

    torch's thread count is process state (per thread on OpenMP builds, with a default for new threads). A
    nested block restores its outer block's count; a thread's outermost block restores the count from before the
    first block of all began, so overlapping blocks of several threads, left in any order, restore it too.
    """
    if count is None:
        yield
        return
    import torch

    global _threads_active, _threads_original
    with _threads_lock:
        if _threads_active == 0:
            _threads_original = torch.get_num_threads()
        _threads_active += 1
        before = torch.get_num_threads()
        depth = getattr(_threads_depth, "value", 0)
        _threads_depth.value = depth + 1
        torch.set_num_threads(count)
    try:
        yield
    finally:
        with _threads_lock:
            _threads_active -= 1
            _threads_depth.value = depth
            torch.set_num_threads(before if depth else _threads_original)
