"""The module a trainer and the in-process engine share has one user at a time; torch thread counts are scoped."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from art_core import CallRecord, TrainConfig, Trajectory, TrajectoryGroup
from art_core._ownership import module_ownership, torch_threads
from art_core.config import LoraSettings
from art_core.engines.base import SamplingParams
from art_core.engines.transformers import TransformersEngine
from art_core.errors import EngineError, TrainingError
from art_core.training.loading import load_policy
from art_core.training.trainer import GRPOTrainer

PROMPT = list(range(100, 140))


def _group() -> TrajectoryGroup:
    completions = [[201, 202, 2], [301, 2], [401, 402, 403, 2], [501, 2]]
    return TrajectoryGroup(Trajectory(calls=[CallRecord(prompt_token_ids=PROMPT, completion_token_ids=c)],
                                      reward=float(i == 0)) for i, c in enumerate(completions))


def _adapter(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture
async def shared(tiny_model_dir):
    """A trainer and an engine decoding the trainer's own module (LocalBackend's shared-module layout)."""
    model, tokenizer = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    trainer = GRPOTrainer(model, tokenizer)
    engine = TransformersEngine(model, tokenizer)
    yield trainer, engine
    await engine.aclose()


async def test_the_trainer_refuses_a_module_an_engine_serves(shared):
    trainer, engine = shared
    before = _adapter(trainer.model)
    with pytest.raises(TrainingError, match=r"serves \(is not paused\).*await engine.pause\(\)"):
        trainer.train_step([_group()], TrainConfig(learning_rate=1e-2))
    after = _adapter(trainer.model)
    assert all(torch.equal(before[n], after[n]) for n in before)  # nothing was changed
    assert module_ownership(trainer.model).holder is None

    await engine.pause()
    assert trainer.train_step([_group()], TrainConfig(learning_rate=1e-2))["trained"] == 1.0
    await engine.resume()
    (out,) = await engine.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0))
    assert out.token_ids  # serving again after the step


async def test_a_decode_while_the_trainer_holds_the_module_fails_clearly(shared):
    trainer, engine = shared
    loop = asyncio.get_running_loop()
    inside: asyncio.Future[None] = loop.create_future()
    release = threading.Event()

    def progress(done: int, total: int) -> None:  # the step holds the module here, until the test releases it
        if not inside.done():
            loop.call_soon_threadsafe(lambda: inside.done() or inside.set_result(None))
            release.wait()

    await engine.pause()
    step = asyncio.ensure_future(asyncio.to_thread(trainer.train_step, [_group()], TrainConfig(), progress=progress))
    try:
        await asyncio.wait({step, inside}, return_when=asyncio.FIRST_COMPLETED)
        assert inside.done(), step.result()  # the step is in progress (a failure shows its error)
        assert module_ownership(trainer.model).holder == "trainer"
        await engine.resume()  # misuse: the engine serves again mid-step
        with pytest.raises(EngineError, match="a training step holds the module this engine decodes"):
            await engine.generate(PROMPT, SamplingParams(max_tokens=3))
        with pytest.raises(EngineError, match="must be paused for the step"):
            engine.generate_batch([PROMPT], [SamplingParams(max_tokens=3)])
        await engine.pause()
    finally:
        release.set()
    assert (await step)["trained"] == 1.0
    assert module_ownership(trainer.model).holder is None
    await engine.resume()
    (out,) = await engine.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0))
    assert out.token_ids


def test_an_engine_with_its_own_module_never_contends(tiny_model_dir):
    model, tokenizer = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    other, _ = load_policy(tiny_model_dir, LoraSettings(), device="cpu")
    engine = TransformersEngine(other, tokenizer)  # serving, but another module
    assert GRPOTrainer(model, tokenizer).train_step([_group()], TrainConfig())["trained"] == 1.0
    assert engine.generate_batch([PROMPT], [SamplingParams(max_tokens=2)])[0][0].token_ids


def test_nested_torch_thread_blocks_restore_each_count():
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
        with torch_threads(3):
            assert torch.get_num_threads() == 3
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with torch_threads(None):
        assert torch.get_num_threads() == before


def test_overlapping_torch_thread_blocks_of_two_threads_restore_the_count():
    """Two models stepping at once, each in a block of its own, the first to enter leaving first: the count
    before the first block comes back, in both threads and for threads started afterwards."""
    before = torch.get_num_threads()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, int] = {}

    def first() -> None:
        with torch_threads(1):
            a_in.set()
            b_in.wait()
        seen["a_after"] = torch.get_num_threads()
        a_out.set()

    def second() -> None:  # started while the first block is open: the thread begins with its count
        with torch_threads(3):
            b_in.set()
            a_out.wait()
            seen["b_inside"] = torch.get_num_threads()
        seen["b_after"] = torch.get_num_threads()

    a = threading.Thread(target=first)
    a.start()
    a_in.wait()
    b = threading.Thread(target=second)
    b.start()
    a.join()
    b.join()
    fresh = threading.Thread(target=lambda: seen.update(fresh=torch.get_num_threads()))
    fresh.start()
    fresh.join()
    assert seen == {"a_after": before, "b_inside": 3, "b_after": before, "fresh": before}
    assert torch.get_num_threads() == before
