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
    LocalBackend(path=tmp_path, **LocalBackend.serving_during_steps())  # the helper names that layout
    assert LocalBackend.serving_during_steps("vllm") == {"pause_during_step": False}  # vLLM's weights are its own


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
        gate.close() if isinstance(gate, (DecodeGate, GatedReplica)) else gate._released.set()


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


async def test_on_cpu_a_step_and_the_engine_split_the_threads(tiny_model_dir: Path, tmp_path: Path) -> None:
    """With neither thread count given, while a step trains the trainer has half of torch's threads (the odd one)
    and the engine decodes with the rest; between steps the engine has them all. A request made while the step's
    forward is held (by an event the test sets) shows both counts at once. Pausing for steps splits nothing."""
    from art_core._ownership import torch_threads

    model = TrainableModel(name="threads", base_model=tiny_model_dir)
    in_step, release = threading.Event(), threading.Event()
    trained_with: list[int] = []
    decoded_with: list[int] = []

    def in_training(module: Any, args: Any) -> None:
        if not in_step.is_set():
            trained_with.append(torch.get_num_threads())
            in_step.set()
            release.wait(120)

    async def decode_threads() -> set[int]:
        decoded_with.clear()
        await model.sample(CHAT, max_tokens=2, temperature=0.0)
        return set(decoded_with)

    with torch_threads(3):  # the process's count, as the backend finds it when it loads the model
        async with LocalBackend(path=tmp_path, show_progress=False, pause_during_step=False,
                                transformers=TransformersOptions(separate_module=True)) as backend:
            await model.register(backend)
            slot = backend._models.get(model.spec)
            hooks = [slot.trainer.model.get_base_model().model.layers[0].register_forward_pre_hook(in_training),
                     slot.engine.model.register_forward_pre_hook(lambda m, a: decoded_with.append(
                         torch.get_num_threads()))]
            training = None
            try:
                between = await decode_threads()
                training = asyncio.create_task(model.train([_group(0)], config=CONFIG))
                assert await asyncio.to_thread(in_step.wait, 120), "the step never reached its forward"
                during = await decode_threads()
                release.set()
                await training
                after = await decode_threads()
            finally:
                release.set()
                for hook in hooks:
                    hook.remove()
                if training is not None:
                    await asyncio.wait([training], timeout=120)
        assert between == {3} and trained_with == [2] and during == {1} and after == {3}

        paused = TrainableModel(name="threads-paused", base_model=tiny_model_dir)
        async with LocalBackend(path=tmp_path / "paused", show_progress=False,
                                transformers=TransformersOptions(separate_module=True)) as backend:
            await paused.register(backend)
            assert backend._models.get(paused.spec).engine.num_threads is None  # phases never overlap: no split


async def test_art_core_serve_during_steps_answers_clients_while_a_step_trains(tiny_model_dir: Path,
                                                                              tmp_path: Path,
                                                                              gates: list[Any]) -> None:
    """``art-core serve --serve-during-steps``: a ``RemoteBackend`` client's request made while the server trains
    is answered at once by the last checkpoint; the next is answered by the new one."""
    from inprocess_server import server_in_thread

    from art_core.backends.remote import RemoteBackend
    from art_core.server.run import ServerSettings

    options = ServerSettings(pause_during_step=False).backend_options  # what the CLI flag gives LocalBackend
    assert options["pause_during_step"] is False and options["transformers"].separate_module
    model = TrainableModel(name="remote-async", base_model=tiny_model_dir)
    with server_in_thread(tmp_path / "server", **options) as server:
        async with RemoteBackend(server.url, show_progress=False) as backend:
            await model.register(backend)
            step_gate = StepGate(server.backend._models.get(model.spec).steps)
            gates.append(step_gate)
            training = asyncio.create_task(model.train([_group(0)], config=CONFIG))
            await step_gate.wait_entered()
            (during,) = await model.sample(CHAT, max_tokens=4, temperature=0.0)
            assert during.calls[0].adapter_step == 0 and not training.done()
            step_gate.open()
            await training
            (after,) = await model.sample(CHAT, max_tokens=4, temperature=0.0)
            assert model.step == 1 and after.calls[0].adapter_step == 1


async def _within(condition: Any, what: str, seconds: float = 120.0) -> None:
    """Wait until ``condition()`` holds, failing with ``what`` after ``seconds`` (a bound against a hang when the
    behaviour under test is missing, not a timing the test relies on)."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.01)


class _Remote:
    """``handle.method`` as the router calls it: ``await handle.method.remote(*args)``."""

    def __init__(self, call: Any) -> None:
        self.remote = call


class GatedReplica:
    """A replica's Ray actor handle that calls through to the real actor, holding at gates the test opens: the
    answer of the next ``generate`` once ``hold_next_answer()`` was called, and every ``load_adapter`` (thread-safe
    events: the router may run on any loop). Other methods are the handle's own."""

    loading_now = 0
    """Replicas inside ``load_adapter`` at this moment (all instances)."""
    loading_most = 0

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.answers: list[int] = []  # adapter step of each answer given
        self.loads: list[int] = []  # steps asked to load
        self.load_entered, self.load_released = threading.Event(), threading.Event()
        self.answer_held, self.answer_released = threading.Event(), threading.Event()
        self._hold_next = False
        self.generate, self.load_adapter = _Remote(self._generate), _Remote(self._load_adapter)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.handle, name)

    def hold_next_answer(self) -> None:
        self._hold_next = True

    def close(self) -> None:
        self.load_released.set()
        self.answer_released.set()

    async def _generate(self, prompt: list[int], params: Any) -> Any:
        hold, self._hold_next = self._hold_next, False
        outputs = await self.handle.generate.remote(prompt, params)
        if hold:
            self.answer_held.set()
            await asyncio.to_thread(self.answer_released.wait)
        self.answers.append(outputs[0].adapter_step)
        return outputs

    async def _load_adapter(self, files: Any, step: int) -> int:
        GatedReplica.loading_now += 1
        GatedReplica.loading_most = max(GatedReplica.loading_most, GatedReplica.loading_now)
        try:
            self.loads.append(step)
            self.load_entered.set()
            await asyncio.to_thread(self.load_released.wait)
            return await self.handle.load_adapter.remote(files, step)
        finally:
            GatedReplica.loading_now -= 1


async def test_ray_replicas_serve_during_a_step_and_switch_one_at_a_time(cluster: Any, tiny_model_dir: Path,
                                                                        tmp_path: Path, gates: list[Any]) -> None:
    """``RayBackend(pause_during_step=False)`` with two replicas: requests are answered while the step trains and
    while the checkpoint is published; a replica takes it only once its request in flight has finished (on the
    old adapter), and the replicas load it one after the other, never both at once."""
    import os

    from art_core.backends.ray import RayBackend

    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": os.pathsep.join([str(root / "core"), str(root)]), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    model = TrainableModel(name="ray-async", base_model=tiny_model_dir)
    async with RayBackend(address=cluster.address, path=tmp_path, num_threads=1, rollout_workers=1,
                          inference_replicas=2, pause_during_step=False, runtime_env={"env_vars": env}) as backend:
        await model.register(backend)
        runner, router = backend._models.get(model.spec).steps, backend.router(model.spec)
        real = list(router._replicas)
        gated = [GatedReplica(handle) for handle in real]
        router._replicas = list(gated)
        gates.extend(gated)
        GatedReplica.loading_now = GatedReplica.loading_most = 0
        step_gate = StepGate(runner)
        gates.append(step_gate)
        training = asyncio.create_task(model.train([_group(0)], config=CONFIG))
        try:
            await step_gate.wait_entered()
            (during,) = await model.sample(CHAT, max_tokens=4, temperature=0.0)
            assert during.calls[0].adapter_step == 0 and not training.done()

            # A request held on its replica (answered by checkpoint 0, not yet returned) while checkpoint 1 is published.
            for g in gated:
                g.hold_next_answer()
            held = asyncio.create_task(model.sample(CHAT, max_tokens=4, temperature=0.0))
            await _within(lambda: any(g.answer_held.is_set() for g in gated), "no replica answered the request")
            busy = next(i for i, g in enumerate(gated) if g.answer_held.is_set())
            for g in gated:
                g._hold_next = False
            step_gate.open()
            for i, g in enumerate(gated):  # the router switches replica 0, then replica 1
                await _within(lambda: router.switching == i, f"replica {i} was never taken out of routing alone")
                if i == busy:  # the replica waits for its request in flight before it loads
                    assert g.loads == [] and not held.done()
                    g.answer_released.set()
                    (old,) = await held
                    assert old.calls[0].adapter_step == 0
                assert await asyncio.to_thread(g.load_entered.wait, 120), f"replica {i} never loaded the checkpoint"
                # While replica i loads, the other one answers, with the checkpoint it serves.
                (meanwhile,) = await model.sample(CHAT, max_tokens=4, temperature=0.0)
                assert meanwhile.calls[0].adapter_step == (0 if i == 0 else 1)
                assert gated[1 - i].answers[-1] == meanwhile.calls[0].adapter_step
                g.load_released.set()
            await training
        finally:  # on a failure, let the step end before the backend closes
            step_gate._released.set()
            for g in gated:
                g.close()
            await asyncio.wait([training], timeout=120)
            router._replicas = real
        assert GatedReplica.loading_most == 1, "two replicas loaded at once"
        assert [g.loads for g in gated] == [[1], [1]] and router.adapter_step == 1 and model.step == 1
        for handle in real:
            assert await handle.adapter_step.remote() == 1
        (after,) = await model.sample(CHAT, max_tokens=4, temperature=0.0)
        assert after.calls[0].adapter_step == 1



async def test_a_ray_step_trains_while_the_checkpoint_before_it_is_written(cluster: Any, tiny_model_dir: Path,
                                                                          tmp_path: Path) -> None:
    """Serving during steps, the trainer does not wait for the driver's disk: a Ray step's checkpoint files come
    back as bytes (``Trained.detached``), so step 2 trains while checkpoint 1 is still being written; checkpoints
    are then written, published and their history rows appended in step order. The write of checkpoint 1 is held
    by a gate the test opens (it wraps the backend's real save, which then runs)."""
    import os

    from art_core.backends.ray import RayBackend

    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": os.pathsep.join([str(root / "core"), str(root)]), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    model = TrainableModel(name="ray-detached", base_model=tiny_model_dir)
    async with RayBackend(address=cluster.address, path=tmp_path, num_threads=1, rollout_workers=1,
                          pause_during_step=False, runtime_env={"env_vars": env}) as backend:
        await model.register(backend)
        runner = backend._models.get(model.spec).steps
        work, train = runner.work, runner.work.train
        events: list[str] = []
        writing_1, release_1, trained_2 = threading.Event(), threading.Event(), asyncio.Event()

        async def traced(groups: Any, config: Any, *, step: int, **options: Any) -> Any:
            events.append(f"train {step}")
            result = await train(groups, config, step=step, **options)
            events.append(f"trained {step}")
            assert result.detached and result.save is not None
            save = result.save

            def held_save(folder: Path) -> None:  # runs in a helper thread, as the real save does
                if step == 1:
                    writing_1.set()
                    assert release_1.wait(300), "the test never released checkpoint 1's write"
                save(folder)
                events.append(f"written {step}")

            result.save = held_save
            if step == 2:
                trained_2.set()
            return result

        work.train = traced  # type: ignore[method-assign]  # this runner's instance attribute
        await model.prepare_training(CONFIG)  # the ranks' GRPOTrainer.prepare, as pipeline calls it (no copies here)
        try:
            first = asyncio.create_task(model.train([_group(0)], config=CONFIG))
            assert await asyncio.to_thread(writing_1.wait, 300), "checkpoint 1 was never written"
            second = asyncio.create_task(model.train([_group(1)], config=CONFIG))
            await asyncio.wait_for(trained_2.wait(), 300)  # a bound for failure, not a timing
            assert events == ["train 1", "trained 1", "train 2", "trained 2"]
            assert await model.checkpoints() == []
            assert not first.done() and not second.done() and model.step == 0
        finally:
            release_1.set()
        assert (await first)["trained"] == 1.0
        await second
        del work.train
        assert events[4:] == ["written 1", "written 2"] and model.step == 2
        assert [row["step"] for row in await model.history()] == [1, 2]
        assert await model.checkpoints() == [1, 2]
        (after,) = await model.sample(CHAT, max_tokens=4, temperature=0.0)
        assert after.calls[0].adapter_step == 2
