"""The step semantics every backend keeps (``art_core.backends.base``), one suite run on Local, Remote and Ray.

- two ``train`` calls on one model at once: the second waits for the first, both succeed, two steps;
- a checkpoint the engine cannot serve: ``train`` raises, the gateway stays paused with the error, ``sample``
  says why, and the next step that publishes resumes serving;
- ``sample`` during a step: it waits, then answers with the checkpoint the step wrote.

"A step in progress" is held by a ``StepGate`` the test opens: it wraps the backend's training (``StepWork.train``)
and calls through to it, so the real step runs once released. Remote runs ``art-core serve``'s app in a thread of
this process (``inprocess_server.py``), so the test can hold the server's step the same way.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from inprocess_server import server_in_thread

from art_core import (
    CallRecord,
    LocalBackend,
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
)
from art_core.backends._steps import StepRunner
from art_core.errors import EngineError

CONFIG = TrainConfig(learning_rate=1e-2)
CHAT = [{"role": "user", "content": "hi"}]


def _group(k: int) -> TrajectoryGroup:
    prompt = list(range(100 + k, 120 + k))
    return TrajectoryGroup(
        Trajectory(calls=[CallRecord(prompt_token_ids=prompt, completion_token_ids=[200 + i, 2])], reward=float(i))
        for i in range(4))


class StepGate:
    """Holds every step inside its training until ``open()``; the real training runs once released.

    Thread-safe: the step may run on another loop (the in-process server's).
    """

    def __init__(self, runner: StepRunner) -> None:
        self.entries = 0
        self.entered = threading.Event()
        self._released = threading.Event()
        work, train = runner.work, runner.work.train

        async def held(*args: Any, **kwargs: Any) -> Any:
            self.entries += 1
            self.entered.set()
            await asyncio.to_thread(self._released.wait)
            return await train(*args, **kwargs)

        work.train = held  # type: ignore[method-assign]  # the instance's attribute, removed by open()
        self._work = work

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 300), "no step reached its training"

    def open(self) -> None:
        self._released.set()
        del self._work.train  # the class's method again


def _failing_publish(runner: StepRunner) -> Callable[[], None]:
    """Make the next publish fail as an engine that cannot load the adapter would. A stand-in: the transformers
    engine that decodes the trainer's own module never fails to take a checkpoint. Returns the undo."""
    async def publish(checkpoint: Path, step: int) -> None:
        raise EngineError(f"adapter {checkpoint.name} did not load (the test's stand-in for a broken engine)")

    runner.work.publish = publish  # type: ignore[method-assign]
    return lambda: delattr(runner.work, "publish")


async def _until(condition: Callable[[], bool]) -> None:
    """Wait until ``condition()`` holds: a state of another task or thread the test has no handle to await."""
    while not condition():
        await asyncio.sleep(0.01)


@dataclass
class Served:
    kind: str
    model: TrainableModel
    runner: StepRunner
    """The model's step runner (on the server, for Remote)."""


@pytest.fixture(params=["local", "remote", "ray"])
async def served(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[Served]:
    model = TrainableModel(name="steps", base_model=tiny_model_dir)
    if request.param == "local":
        async with LocalBackend(path=tmp_path, show_progress=False) as backend:
            await model.register(backend)
            yield Served(request.param, model, backend._models.get(model.spec).steps)
    elif request.param == "remote":
        from art_core.backends.remote import RemoteBackend

        with server_in_thread(tmp_path / "server") as server:
            async with RemoteBackend(server.url, show_progress=False) as backend:
                await model.register(backend)
                yield Served(request.param, model, server.backend._models.get(model.spec).steps)
    else:
        cluster = request.getfixturevalue("cluster")  # conftest.py: one simulated Ray cluster for the module
        from art_core.backends.ray import RayBackend

        root = Path(__file__).resolve().parents[2]
        env = {"PYTHONPATH": os.pathsep.join([str(root / "core"), str(root)]), "OMP_NUM_THREADS": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        async with RayBackend(address=cluster.address, path=tmp_path, num_threads=1, rollout_workers=1,
                              runtime_env={"env_vars": env}) as backend:
            await model.register(backend)
            yield Served(request.param, model, backend._models.get(model.spec).steps)


async def test_concurrent_train_calls_run_one_after_the_other(served: Served) -> None:
    model, runner = served.model, served.runner
    gate = StepGate(runner)
    first = asyncio.create_task(model.train([_group(0)], config=CONFIG))
    await gate.wait_entered()
    second = asyncio.create_task(model.train([_group(1)], config=CONFIG))
    await _until(lambda: runner.waiting_steps == 1)  # the second call waits for the first; it does not fail
    assert gate.entries == 1 and not second.done()
    gate.open()
    one, two = await asyncio.gather(first, second)
    assert one["trained"] and two["trained"] and model.step == 2
    history = await model.history()
    assert [row["step"] for row in history] == [1, 2] and {row["kind"] for row in history} == {"grpo"}
    assert await model.checkpoints() == [1, 2]


async def test_failed_publish_keeps_the_gateway_paused_with_the_error(served: Served) -> None:
    model, runner = served.model, served.runner
    undo = _failing_publish(runner)
    with pytest.raises(EngineError, match="checkpoint 0001 was trained .* gateway stays paused") as failed:
        await model.train([_group(0)], config=CONFIG)
    assert "did not load" in str(failed.value)
    undo()
    assert (await model.fetch_rollout_status("probe")).gateway == "paused"
    with pytest.raises(EngineError, match="does not serve checkpoint 0001 .*did not load"):
        await model.sample(CHAT, max_tokens=3, seed=1)
    assert "did not load" in (await model.history())[-1]["adapter_load_error"]
    assert await model.checkpoints() == [1]  # nothing lost: the step is on disk
    # The next step publishes: serving resumes, on the new checkpoint.
    await model.train([_group(1)], config=CONFIG)
    assert model.step == 2 and (await model.fetch_rollout_status("probe")).gateway == "serving"
    (sampled,) = await model.sample(CHAT, max_tokens=3, seed=1)
    assert sampled.calls[0].adapter_step == 2


async def test_sample_during_a_step_waits_and_answers_with_the_new_checkpoint(served: Served) -> None:
    model, runner = served.model, served.runner
    gate = StepGate(runner)
    training = asyncio.create_task(model.train([_group(0)], config=CONFIG))
    await gate.wait_entered()
    sampling = asyncio.create_task(model.sample(CHAT, max_tokens=3, seed=1))
    await _until(lambda: runner.waiting_samples == 1)
    assert not sampling.done()
    gate.open()
    await training
    (sampled,) = await sampling
    assert model.step == 1 and sampled.calls[0].adapter_step == 1


async def test_dropped_groups_are_reported_at_the_callers_line(served: Served) -> None:
    from art_core.training.trainer import ZeroVarianceGroupsWarning

    if served.kind == "remote":
        pytest.skip("the step runs on the server: the warning is the server's")
    flat = TrajectoryGroup(Trajectory(calls=_group(5).trajectories[i].calls, reward=1.0) for i in range(4))
    with pytest.warns(ZeroVarianceGroupsWarning, match=r"1 of 2 group\(s\) .* \(indices \[1\]\)") as caught:
        await served.model.train([_group(0), flat], config=CONFIG)
    assert [Path(w.filename).name for w in caught if w.category is ZeroVarianceGroupsWarning] == [Path(__file__).name]


def _sampled_at(k: int, step: int) -> TrajectoryGroup:
    """``_group(k)`` as if the adapter at ``step`` had sampled it (its records' ``adapter_step``)."""
    return TrajectoryGroup(
        Trajectory(calls=[c.model_copy(update={"adapter_step": step}) for c in t.calls], reward=t.reward)
        for t in _group(k).trajectories)


async def test_stale_groups_are_dropped_counted_and_reported(served: Served) -> None:
    """Each backend measures staleness from the checkpoint its trainer is at: after two steps (module at 2), with
    ``max_off_policy=1`` the group sampled at step 0 is dropped, the one from step 1 is trained off-policy."""
    from art_core.training.staleness import StaleGroupsWarning

    model = served.model
    await model.train([_group(0)], config=CONFIG)
    await model.train([_group(1)], config=CONFIG)
    config = TrainConfig(learning_rate=1e-2, max_off_policy=1)
    groups = [_sampled_at(2, 2), _sampled_at(3, 0), _sampled_at(4, 1)]
    if served.kind == "remote":  # the step runs on the server: the warning is the server's
        metrics = await model.train(groups, config=config)
    else:
        with pytest.warns(StaleGroupsWarning, match=r"1 of 3 group\(s\) .*\(indices \[1\]\)") as caught:
            metrics = await model.train(groups, config=config)
        assert [Path(w.filename).name for w in caught if w.category is StaleGroupsWarning] == [Path(__file__).name]
    assert metrics["trained"] == 1.0 and model.step == 3
    assert metrics["groups_stale"] == 1 and metrics["groups_used"] == 2
    assert (metrics["groups_staleness_0"], metrics["groups_staleness_1"], metrics["groups_staleness_2"]) == (1, 1, 1)
    assert metrics["samples_off_policy"] == 4  # the group sampled at step 1: its ratio is against its sampler
    assert (await model.history())[-1]["groups_stale"] == 1
