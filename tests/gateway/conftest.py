"""Gateway test set-up: a fake engine over the real SmolLM2 tokenizer, and a gateway on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeEngine

from art_core.gateway import Gateway, GatewaySettings


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir: Path) -> Any:
    """SmolLM2's tokenizer and tool chat template (the fake engine needs no weights)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture
def engine(tokenizer: Any) -> FakeEngine:
    return FakeEngine(tokenizer)


@pytest.fixture
async def gateway(engine: FakeEngine, tmp_path: Path) -> AsyncIterator[Gateway]:
    settings = GatewaySettings(model_name="agent", records_path=tmp_path / "records.jsonl")
    async with Gateway(engine, settings) as gw:
        yield gw


@pytest.fixture
async def tiny_gateway(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[Gateway]:
    """A gateway over the transformers engine on the tiny random model, recording to tmp_path."""
    from art_core.engines.transformers import TransformersEngine

    engine = await TransformersEngine.from_pretrained(tiny_model_dir, device="cpu")
    try:
        async with Gateway(engine, GatewaySettings(records_path=tmp_path / "records.jsonl")) as gateway:
            yield gateway
    finally:
        await engine.aclose()
