"""The Backend contract: ``TrainableModel`` reaches ``LocalBackend`` only through it, and its bookkeeping calls."""

from __future__ import annotations

import pytest

from art_core import (
    Backend,
    CallRecord,
    CheckpointError,
    ConfigError,
    LocalBackend,
    LoraSettings,
    ModelSpec,
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
)


def _group() -> TrajectoryGroup:
    prompt = list(range(100, 120))
    return TrajectoryGroup(
        Trajectory(calls=[CallRecord(prompt_token_ids=prompt, completion_token_ids=[200 + i, 2])], reward=float(i))
        for i in range(4))


def test_local_backend_implements_the_contract(tmp_path):
    assert isinstance(LocalBackend(path=tmp_path), Backend)


async def test_register_refuses_what_is_not_a_backend(tmp_path):
    model = TrainableModel(name="m")
    with pytest.raises(ConfigError, match="needs a backend .* got str"):
        await model.register("http://gpu-box:7999")  # type: ignore[arg-type]


def test_spec_is_plain_data():
    model = TrainableModel(name="m", project="p", base_model="/models/x")
    spec = ModelSpec.model_validate_json(model.spec.model_dump_json())
    assert spec == model.spec and spec.base_model == "/models/x" and spec.lora == model.lora


async def test_checkpoints_history_and_deletion(tiny_model_dir, tmp_path):
    model = TrainableModel(name="ck", base_model=tiny_model_dir)
    async with LocalBackend(path=tmp_path, show_progress=False, serve=False) as backend:
        await model.register(backend)
        assert await model.checkpoints() == [] and await model.history() == []
        for _ in range(3):
            await model.train([_group()], config=TrainConfig(learning_rate=1e-2))
        assert await model.checkpoints() == [1, 2, 3]
        assert [row["step"] for row in await model.history()] == [1, 2, 3]
        with pytest.raises(CheckpointError, match="0003 is the one being served"):
            await model.delete_checkpoints([1, 3])
        assert await model.delete_checkpoints([1, 2, 7]) == [1, 2]  # 7 never existed: ignored
        assert await model.checkpoints() == [3]
        assert sorted(p.name for p in (model.model_dir / "checkpoints").iterdir()) == ["0003"]


async def test_a_model_resumed_with_another_adapter_shape_is_refused(tiny_model_dir, tmp_path):
    """The checkpoint would load as saved and the new LoraSettings be silently ignored (and recorded as if held)."""
    model = TrainableModel(name="shaped", base_model=tiny_model_dir)
    async with LocalBackend(path=tmp_path, show_progress=False, serve=False) as backend:
        await model.register(backend)
        await model.train([_group()], config=TrainConfig(learning_rate=1e-2))
    other = TrainableModel(name="shaped", base_model=tiny_model_dir, lora=LoraSettings(rank=4, alpha=8))
    async with LocalBackend(path=tmp_path, show_progress=False, serve=False) as backend:
        with pytest.raises(ConfigError, match=r"whose adapter has rank 8 \(asked: 4\), alpha 16 \(asked: 8\)"):
            await other.register(backend)
        same = TrainableModel(name="shaped", base_model=tiny_model_dir, lora=LoraSettings(seed=3))  # seed: not shape
        await same.register(backend)
        assert same.step == 1
