"""``LocalBackend(pause_during_step=False)``: the engine keeps serving the last checkpoint while a step trains, and
switches when the next is published, each request running wholly on one adapter.

Run on the transformers engine with weights of its own (``TransformersOptions(separate_module=True)``, the
"separate-module" layout), which serves while training on CPU; the "shared-module" layout is refused. A request is
held mid-decode by a gate the test opens (the engine's decode thread waits on it after the request's first tokens),
never by a sleep.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_step_contract import CHAT, StepGate, _group, _until
from transformers import AutoModelForCausalLM

from art_core import ConfigError, LocalBackend, TrainableModel, TrainConfig
from art_core.backends import TransformersOptions

CONFIG = TrainConfig(learning_rate=1e-2)  # large enough that checkpoint 1's log-probs differ from the base's


def test_the_shared_module_layout_is_refused_with_the_layout_that_works(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'shared-module' layout.*TransformersOptions\(separate_module=True\)"):
        LocalBackend(path=tmp_path, pause_during_step=False)
    with pytest.raises(ConfigError, match="shared-module"):
        LocalBackend(path=tmp_path, device="cpu", pause_during_step=False)
    LocalBackend(path=tmp_path, pause_during_step=False, transformers=TransformersOptions(separate_module=True))


class DecodeGate:
    """Holds the engine's decode thread after a request's second token until ``open()`` (its ``_sample`` wrapped on
    the instance; removed by ``close()``)."""

    def __init__(self, engine: Any) -> None:
        self.entered, self._released, self.engine = threading.Event(), threading.Event(), engine
        sample = engine._sample

        def held(rows: list[Any], logits: torch.Tensor) -> torch.Tensor:
            chosen = sample(rows, logits)
            if any(len(row.tokens) == 2 for row in rows) and not self._released.is_set():
                self.entered.set()
                self._released.wait()
            return chosen

        engine._sample = held

    def open(self) -> None:
        self._released.set()

    def close(self) -> None:
        self._released.set()
        del self.engine._sample


@pytest.fixture
def gates() -> Iterator[list[Any]]:
    opened: list[Any] = []
    yield opened
    for gate in opened:
        gate.close() if isinstance(gate, DecodeGate) else gate._released.set()


@torch.no_grad()
def _completion_logprobs(model: Any, prompt: list[int], completion: list[int]) -> list[float]:
    ids = torch.tensor([prompt + completion])
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    return logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]][len(prompt) - 1:].tolist()


async def test_requests_are_served_during_a_step_each_on_one_adapter(tiny_model_dir: Path, tmp_path: Path,
                                                                     gates: list[Any]) -> None:
    model = TrainableModel(name="async", base_model=tiny_model_dir)
    async with LocalBackend(path=tmp_path, show_progress=False, pause_during_step=False,
                            transformers=TransformersOptions(separate_module=True)) as backend:
        await model.register(backend)
        runner, engine = backend._models.get(model.spec).steps, backend._models.get(model.spec).engine

        # A request that arrives while the step trains is answered at once, by checkpoint 0.
        step_gate = StepGate(runner)
        gates.append(step_gate)
        training = asyncio.create_task(model.train([_group(0)], config=CONFIG))
        await step_gate.wait_entered()
        (during,) = await model.sample(CHAT, max_tokens=4, temperature=0.0)
        assert during.calls[0].adapter_step == 0 and not training.done()
        assert (await model.fetch_rollout_status("probe")).gateway == "serving"

        # A request held mid-decode on checkpoint 0 while checkpoint 1 is trained and published: the publish waits
        # for it, and it finishes on checkpoint 0 (its record and its log-probs say so).
        decode_gate = DecodeGate(engine)
        gates.append(decode_gate)
        held = asyncio.create_task(model.sample(CHAT, max_tokens=6, temperature=0.0))
        await asyncio.to_thread(decode_gate.entered.wait)
        step_gate.open()
        await _until(lambda: (backend.model_dir(model.spec) / "checkpoints" / "0001").is_dir())
        assert not held.done() and not training.done()  # checkpoint 1 is written; its publish waits for the request
        decode_gate.open()
        (old,) = await held
        await training
        assert model.step == 1 and engine.adapter_step == 1
        (new,) = await model.sample(CHAT, max_tokens=6, temperature=0.0)

    call, after = old.calls[0], new.calls[0]
    assert call.adapter_step == 0 and after.adapter_step == 1
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    expected = _completion_logprobs(base, call.prompt_token_ids, call.completion_token_ids)
    assert call.logprobs == pytest.approx(expected, abs=1e-4)  # every token was sampled by checkpoint 0
    moved = _completion_logprobs(base, after.prompt_token_ids, after.completion_token_ids)
    assert after.logprobs != pytest.approx(moved, abs=1e-4)  # checkpoint 1 is another policy: the check can fail
