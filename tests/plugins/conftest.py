"""Fixtures of the adapter tests: ``model``, the tiny random Qwen2 registered as ``"agent"`` (modules that need a
model fitted to a script, or scoped differently, define their own ``model``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from art_core import LocalBackend, TrainableModel


@pytest.fixture
async def model(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[TrainableModel]:
    model = TrainableModel(name="agent", base_model=tiny_model_dir)
    async with LocalBackend(path=tmp_path, show_progress=False) as backend:
        await model.register(backend)
        yield model
