"""``art_core.pipeline``: rollouts and steps run side by side within a staleness bound.

Real steps on the tiny model through ``LocalBackend``; each rollout is a real ``model.sample`` (rewards by index, so
every group teaches something). "A step in progress" and "a rollout in flight" are held by gates the test opens
(``StepGate``, events), never by sleeps.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from art_core import (LocalBackend, RolloutError, TrainableModel, TrainConfig, TrajectoryError, TrajectoryGroup,
                      pipeline)
from art_core._cpu import onednn_packing_available
from art_core.errors import ConfigError, LifecycleError
from art_core.backends import TransformersOptions

sys.path.insert(0, str(Path(__file__).parent / "backends"))
from test_step_contract import CHAT, StepGate, _until  # noqa: E402

CONFIG = TrainConfig(learning_rate=1e-2)


async def _play_sample(model: TrainableModel) -> TrajectoryGroup:
    """One group: two real samples, rewarded 0 and 1."""
    sampled = await model.sample(CHAT, n=2, max_tokens=3, temperature=1.0)
    return TrajectoryGroup(t.model_copy(update={"reward": float(i)}) for i, t in enumerate(sampled))


async def _registered(tmp_path: Path, tiny_model_dir: Path, **options: Any) -> AsyncIterator[TrainableModel]:
    model = TrainableModel(name="pipe", base_model=tiny_model_dir)
    async with LocalBackend(path=tmp_path, show_progress=False, **options) as backend:
        await model.register(backend)
        yield model


@pytest.fixture
async def model(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[TrainableModel]:
    async for registered in _registered(tmp_path, tiny_model_dir):
        yield registered


def _runner(model: TrainableModel) -> Any:
    return model.backend._models.get(model.spec).steps


async def test_max_off_policy_0_is_the_synchronous_loop(model: TrainableModel) -> None:
    started: list[int] = []
    lines: list[str] = []
    played: list[TrajectoryGroup] = []
    seen: list[tuple[int, list[TrajectoryGroup]]] = []

    async def play(task: int) -> TrajectoryGroup:
        started.append(model.step)
        played.append(await _play_sample(model))
        return played[-1]

    report = await pipeline(model, itertools.count(), play, steps=2, groups_per_step=2, max_off_policy=0,
                            concurrency=4, config=CONFIG, log=lines.append,
                            on_step=lambda step, groups: seen.append((step.step, groups)))
    assert started == [0, 0, 1, 1]  # each step's rollouts start once the step before it is served
    assert [s.step for s in report.steps] == [1, 2] and model.step == 2
    assert [step for step, _ in seen] == [1, 2]  # on_step: each step's report and the groups it trained
    assert [{id(g) for g in groups} for _, groups in seen] == [{id(g) for g in played[:2]}, {id(g) for g in played[2:]}]
    for row in await model.history():
        assert row["groups_staleness_0"] == 2 and row["groups_stale"] == 0 and row["samples_off_policy"] == 0
    assert len(lines) == 2 and lines[0].startswith("step 1: reward 0.500, staleness mean 0.00 max 0, 0 group(s) "
                                                   "dropped as stale, 0 rollout(s) failed")


async def test_rollouts_go_on_while_a_step_trains_and_the_next_step_corrects_for_them(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    async for model in _registered(tmp_path, tiny_model_dir, pause_during_step=False,
                                   transformers=TransformersOptions(separate_module=True)):
        gate = StepGate(_runner(model))
        done: list[int] = []
        four_done = asyncio.Event()

        async def play(task: int) -> TrajectoryGroup:
            if task >= 2:  # the next step's rollouts sample while step 1 is held mid-training
                await asyncio.to_thread(gate.entered.wait)
            group = await _play_sample(model)
            done.append(model.step)
            if len(done) == 4:
                four_done.set()
            return group

        running = asyncio.create_task(pipeline(model, itertools.count(), play, steps=2, groups_per_step=2,
                                               max_off_policy=1, concurrency=4, config=CONFIG, log=None))
        await gate.wait_entered()
        await four_done.wait()  # the next step's groups were rolled out while step 1 was held mid-training
        assert done == [0, 0, 0, 0] and not running.done()
        gate.open()
        report = await running
        second = (await model.history())[1]
        assert second["groups_staleness_1"] == 2 and second["groups_stale"] == 0  # sampled by 0, trained from 1
        assert second["samples_off_policy"] == 4  # their ratios are taken against the sampler's log-probs
        assert second["groups_recentred"] == 2  # and their advantages centred on what adapter 1 expects
        assert report.steps[0].seconds_both > 0 and report.steps[0].overlap > 0


class PublishGate:
    """Holds the publishing of checkpoint ``step`` (the engine loading it) until ``open()``; records the order in
    which steps reach the trainer, finish training and are published. Wraps the runner's real ``train`` and
    ``publish`` (instance attributes of the test's own runner)."""

    def __init__(self, runner: Any, step: int) -> None:
        self.events: list[str] = []
        self.holding, self.trained, self._released = asyncio.Event(), {}, asyncio.Event()
        work = runner.work
        train, publish = work.train, work.publish

        async def trained(groups: Any, config: Any, *, step: int, **options: Any) -> Any:
            self.events.append(f"train {step}")
            result = await train(groups, config, step=step, **options)
            self.events.append(f"trained {step}")
            self.trained.setdefault(step, asyncio.Event()).set()
            return result

        async def published(checkpoint: Path, at: int) -> None:
            if at == step:
                self.holding.set()
                await self._released.wait()
            await publish(checkpoint, at)
            self.events.append(f"published {at}")

        work.train, work.publish = trained, published

    def open(self) -> None:
        self._released.set()


async def test_the_next_step_trains_while_the_engine_loads_the_last_checkpoint(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """Serving during steps, the trainer does not wait for the engine: step 2 trains while checkpoint 1 is being
    loaded, which goes on serving checkpoint 0 meanwhile; checkpoints are published and history rows written in
    step order, and each ``train`` returns once the engine serves its checkpoint."""
    async for model in _registered(tmp_path, tiny_model_dir, pause_during_step=False,
                                   transformers=TransformersOptions(separate_module=True)):
        gate = PublishGate(_runner(model), step=1)
        groups = [[await _play_sample(model) for _ in range(2)] for _ in range(2)]
        first = asyncio.create_task(model.train(groups[0], config=CONFIG))
        await gate.holding.wait()
        second = asyncio.create_task(model.train(groups[1], config=CONFIG))
        # step 2 trained while checkpoint 1 is still loading (a bound for failure, not a timing: it fails, not hangs)
        await asyncio.wait_for(gate.trained.setdefault(2, asyncio.Event()).wait(), 120)
        assert gate.events == ["train 1", "trained 1", "train 2", "trained 2"]
        assert not first.done() and not second.done()
        during = (await model.sample(CHAT, max_tokens=2))[0]
        assert during.calls[0].adapter_step == 0
        gate.open()
        assert (await first)["trained"] == 1.0 and model.step == 1
        await second
        assert gate.events[4:] == ["published 1", "published 2"] and model.step == 2
        assert [row["step"] for row in await model.history()] == [1, 2]
        assert (await model.sample(CHAT, max_tokens=2))[0].calls[0].adapter_step == 2


async def test_the_pipeline_starts_the_next_step_while_the_last_checkpoint_loads(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    async for model in _registered(tmp_path, tiny_model_dir, pause_during_step=False,
                                   transformers=TransformersOptions(separate_module=True)):
        gate = PublishGate(_runner(model), step=1)

        async def play(task: int) -> TrajectoryGroup:
            return await _play_sample(model)

        running = asyncio.create_task(pipeline(model, itertools.count(), play, steps=2, groups_per_step=2,
                                               max_off_policy=1, concurrency=4, config=CONFIG, log=None))
        await asyncio.wait_for(gate.trained.setdefault(2, asyncio.Event()).wait(), 120)  # a failure bound only
        assert "published 1" not in gate.events and not running.done()
        gate.open()
        report = await running
        assert [s.step for s in report.steps] == [1, 2] and gate.events[-2:] == ["published 1", "published 2"]
        assert (await model.history())[1]["groups_staleness_1"] == 2  # sampled by checkpoint 0, trained from 1


async def test_with_the_pause_policy_a_step_waits_for_the_last_one_to_be_served(model: TrainableModel) -> None:
    gate = PublishGate(_runner(model), step=1)
    groups = [[await _play_sample(model) for _ in range(2)] for _ in range(2)]
    first = asyncio.create_task(model.train(groups[0], config=CONFIG))
    await gate.holding.wait()
    second = asyncio.create_task(model.train(groups[1], config=CONFIG))
    await _until(lambda: _runner(model).waiting_steps == 1)  # step 2 waits for the trainer
    gate.open()
    await asyncio.gather(first, second)
    assert gate.events == ["train 1", "trained 1", "published 1", "train 2", "trained 2", "published 2"]


async def test_a_failed_rollout_is_counted_and_the_pipeline_goes_on(model: TrainableModel) -> None:
    async def play(task: int) -> TrajectoryGroup:
        if task == 1:
            raise RuntimeError("the agent crashed")
        return await _play_sample(model)

    report = await pipeline(model, itertools.count(), play, steps=2, groups_per_step=2, max_off_policy=0,
                            concurrency=2, config=CONFIG, log=None)
    assert model.step == 2 and report.rollouts_failed == 1
    assert [s.rollouts_failed for s in report.steps] == [1, 0]
    assert str(report.failures[0]) == "the agent crashed"
    assert "1 rollout(s) failed" in report.steps[0].line()


async def test_rollouts_that_keep_failing_stop_the_pipeline_with_the_last_failure(model: TrainableModel) -> None:
    calls = itertools.count(1)

    async def typo(task: int) -> TrajectoryGroup:  # every rollout fails: without a limit the pipeline spun forever
        next(calls)
        raise TypeError("sample() got an unexpected keyword argument 'max_token'")

    with pytest.raises(RolloutError, match=r"5 rollouts failed in a row.*'max_token'.*max_failures_in_a_row=") as caught:
        await pipeline(model, itertools.cycle([0]), typo, steps=1, groups_per_step=1, concurrency=2,
                       max_failures_in_a_row=5, config=CONFIG, log=None)
    assert isinstance(caught.value.__cause__, TypeError) and model.step == 0
    assert next(calls) <= 5 + 2 + 1  # it stopped: at most the rollouts in flight at the fifth failure ran after it

    async def every_other(task: int) -> TrajectoryGroup:  # a success in between resets the count
        if task % 2 == 0:
            raise RuntimeError("a flaky tool")
        return await _play_sample(model)

    report = await pipeline(model, itertools.count(), every_other, steps=2, groups_per_step=1, max_off_policy=0,
                            concurrency=1, max_failures_in_a_row=2, config=CONFIG, log=None)
    assert model.step == 2 and report.rollouts_failed == 2


async def test_a_failed_step_stops_the_pipeline_with_its_trajectories_on_disk(model: TrainableModel) -> None:
    cancelled: list[int] = []
    never = asyncio.Event()

    async def play(task: int) -> TrajectoryGroup:
        if task >= 2:  # the next step's rollouts are in flight when the first step fails
            try:
                await never.wait()
            except asyncio.CancelledError:
                cancelled.append(task)
                raise
        return await _play_sample(model)

    too_short = TrainConfig(learning_rate=1e-2, max_sequence_length=16)  # the chat's prompt alone is longer
    with pytest.raises(TrajectoryError, match="max_sequence_length=16"):
        await pipeline(model, itertools.count(), play, steps=3, groups_per_step=2, max_off_policy=1,
                       concurrency=4, config=too_short, log=None)
    assert sorted(cancelled) == [2, 3] and model.step == 0
    saved = model.backend.model_dir(model.spec) / "trajectories" / "0001.jsonl"
    assert len(saved.read_text().splitlines()) == 2  # the failed step's groups, on disk


async def test_cancelling_stops_cleanly_after_the_step_in_progress(model: TrainableModel) -> None:
    gate = StepGate(_runner(model))
    cancelled: list[int] = []
    in_flight = asyncio.Event()

    async def play(task: int) -> TrajectoryGroup:
        if task >= 2:
            try:
                in_flight.set()
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(task)
                raise
        return await _play_sample(model)

    running = asyncio.create_task(pipeline(model, itertools.count(), play, steps=3, groups_per_step=2,
                                           max_off_policy=1, concurrency=4, config=CONFIG, log=None))
    await gate.wait_entered()
    await in_flight.wait()
    running.cancel()  # Ctrl-C while step 1 trains and rollouts run
    await _until(lambda: len(cancelled) == 2)
    assert not running.done()  # the step in progress finishes first
    gate.open()
    with pytest.raises(asyncio.CancelledError):
        await running
    folder = model.backend.model_dir(model.spec)
    assert await model.checkpoints() == [1] and [row["step"] for row in await model.history()] == [1]
    assert [p.name for p in (folder / "trajectories").iterdir()] == ["0001.jsonl"]
    assert not [p for p in folder.rglob("*") if p.name.startswith(".") or p.name.endswith(".tmp")]  # nothing partial


def test_stalest_groups_are_trained_first() -> None:
    from art_core import CallRecord, Trajectory
    from art_core.pipeline import _Ready, stalest_first

    def sampled_at(step: int | None) -> TrajectoryGroup:
        return TrajectoryGroup([Trajectory(calls=[CallRecord(prompt_token_ids=[1], completion_token_ids=[2],
                                                             adapter_step=step)])])

    ready = [_Ready(sampled_at(s), order) for order, s in enumerate([3, None, 1, 3, 2])]
    taken = stalest_first(ready, 3)
    assert [g.trajectories[0].calls[0].adapter_step for g in taken] == [1, 2, 3]
    assert [r.order for r in ready] == [3, 1]  # left: the later of the two step-3 groups, then the unknown one


async def test_a_steps_groups_come_in_the_order_their_rollouts_started(model: TrainableModel) -> None:
    """Finishing order is a race; the step's order must not be (a seeded synchronous run repeats)."""
    second_done = asyncio.Event()
    seen: list[list[Any]] = []

    async def play(task: int) -> TrajectoryGroup:
        if task == 0:
            await second_done.wait()  # the first rollout to start finishes last
        group = await _play_sample(model)
        if task == 1:
            second_done.set()
        return TrajectoryGroup(group.trajectories, metadata={"task": task})

    await pipeline(model, iter(range(2)), play, steps=1, groups_per_step=2, max_off_policy=0, concurrency=2,
                   config=CONFIG, log=None, on_step=lambda _, groups: seen.append([g.metadata["task"] for g in groups]))
    assert seen == [[0, 1]]


async def test_the_readmes_asynchronous_training_example_runs(tiny_model_dir: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    import json
    import re

    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Asynchronous training", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert 'base_model="smollm2-135m-instruct"' in code
    code = code.replace('base_model="smollm2-135m-instruct"', f"base_model={str(tiny_model_dir)!r}")
    monkeypatch.chdir(tmp_path)
    await asyncio.to_thread(exec, compile(code, "README.md", "exec"), {"__name__": "readme"})  # asyncio.run inside
    out = capsys.readouterr().out
    assert "3 [True, True, True]" in out and out.count("step ") >= 3 and "dropped as stale" in out
    history = tmp_path / ".art" / "demo" / "models" / "adder-async" / "history.jsonl"
    rows = [json.loads(line) for line in history.read_text().splitlines()]
    assert len(rows) == 3 and all(row["staleness_max"] <= 1 for row in rows)


@pytest.mark.skipif(not onednn_packing_available(), reason="this PyTorch has no oneDNN")
async def test_prepare_training_makes_the_first_steps_weight_copies_ahead(model: TrainableModel) -> None:
    """``prepare_training`` makes the trainer's pre-packed copies (each fused layer's base weight, and the LM head)
    before any step, moving no parameter; the first step then trains on those very copies and makes none."""
    from art_core.training.forward import plain_head

    trainer = _runner(model).work.trainer
    config = CONFIG.model_copy(update={"prepacked_base_weights": True})
    before = [p.detach().clone() for p in trainer.params]
    await model.prepare_training(config)
    made = {key: entry[2] for key, entry in trainer._base_copies.items()}
    head = plain_head(trainer.model)
    assert head is not None and id(head.weight) in made and len(made) > 1
    assert all(entry.packed for entry in made.values())
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.params, strict=True))
    await model.train([await _play_sample(model) for _ in range(2)], config=config)
    assert {key: entry[2] for key, entry in trainer._base_copies.items()} == made  # the same objects: none remade
    assert not all(torch.equal(a, b) for a, b in zip(before, trainer.params, strict=True))


async def test_the_pipeline_prepares_the_trainer_while_the_first_rollouts_run(model: TrainableModel) -> None:
    """The trainer's preparation runs beside the first rollouts (held until one has started) and the first step
    trains only once it is done."""
    events: list[str] = []
    work = _runner(model).work
    prepare, train = work.prepare, work.train
    rollout_started = asyncio.Event()

    async def traced_prepare(config: TrainConfig) -> None:
        await rollout_started.wait()
        events.append("prepare")
        await prepare(config)
        events.append("prepared")

    async def traced_train(groups: Any, config: Any, *, step: int, **options: Any) -> Any:
        events.append(f"train {step}")
        return await train(groups, config, step=step, **options)

    async def play(task: int) -> TrajectoryGroup:
        if not rollout_started.is_set():
            events.append("rollout")
            rollout_started.set()
        return await _play_sample(model)

    work.prepare, work.train = traced_prepare, traced_train
    try:
        await pipeline(model, itertools.count(), play, steps=1, groups_per_step=2, max_off_policy=0, concurrency=2,
                       config=CONFIG, log=None)
    finally:
        del work.prepare, work.train
    assert events == ["rollout", "prepare", "prepared", "train 1"]


async def test_tasks_that_run_out_say_how_many_steps_ran_and_every_rollout_failing_raises(
        model: TrainableModel) -> None:
    async def play(task: int) -> TrajectoryGroup:
        return await _play_sample(model)

    with pytest.warns(UserWarning, match=r"tasks ran out after 1 of 2 step\(s\) \(1 group\(s\) left untrained.*"
                                         r"itertools.cycle") as caught:
        report = await pipeline(model, range(3), play, steps=2, groups_per_step=2, max_off_policy=0,
                                concurrency=2, config=CONFIG, log=None)
    assert len(report.steps) == 1 and model.step == 1
    assert [Path(w.filename).name for w in caught if "ran out" in str(w.message)] == [Path(__file__).name]

    async def broken(task: int) -> TrajectoryGroup:  # a finite dataset, shorter than max_failures_in_a_row
        raise KeyError("no such tool")

    with pytest.raises(RolloutError, match=r"ran out with every rollout failed \(5 of 5, 0 step.*KeyError") as failed:
        await pipeline(model, range(5), broken, steps=2, groups_per_step=2, config=CONFIG, log=None)
    assert isinstance(failed.value.__cause__, KeyError) and model.step == 1


async def test_play_returning_something_else_than_a_group_is_a_failure_naming_the_fix(model: TrainableModel) -> None:
    async def play(task: int) -> Any:
        return list((await _play_sample(model)).trajectories)  # forgot TrajectoryGroup(...)

    with pytest.raises(RolloutError, match=r"returned list, not a TrajectoryGroup: return TrajectoryGroup"):
        await pipeline(model, itertools.count(), play, steps=1, groups_per_step=1, concurrency=1,
                       max_failures_in_a_row=2, config=CONFIG, log=None)
    with pytest.raises(ConfigError, match=r"pipeline\(steps=True\): give an int >= 1"):
        await pipeline(model, itertools.count(), play, steps=True, groups_per_step=1)


async def test_a_rollout_whose_play_lets_a_cancellation_out_is_a_failure_and_the_pipeline_goes_on(
        model: TrainableModel) -> None:
    """``play`` raising ``CancelledError`` of its own (a task or timeout inside it, not the pipeline's cancel): a
    failed rollout, counted and replaced. It used to skip the failure accounting: the synchronous loop then waited
    forever for a group that would never come."""
    async def play(task: int) -> TrajectoryGroup:
        if task == 1:
            inner = asyncio.create_task(asyncio.Event().wait())
            inner.cancel()
            await inner  # raises CancelledError out of play, with the pipeline's task not cancelled
        return await _play_sample(model)

    report = await asyncio.wait_for(  # a bound for the regression only: the run itself takes no fixed time
        pipeline(model, itertools.count(), play, steps=2, groups_per_step=2, max_off_policy=0, concurrency=2,
                 config=CONFIG, log=None), timeout=600)
    assert model.step == 2 and report.rollouts_failed == 1
    assert isinstance(report.failures[0], asyncio.CancelledError)


async def test_bad_settings_and_an_unregistered_model_are_refused_before_any_rollout(
        model: TrainableModel, tiny_model_dir: Path) -> None:
    started: list[int] = []

    async def play(task: int) -> TrajectoryGroup:
        started.append(task)
        return await _play_sample(model)

    with pytest.raises(ConfigError, match=r"takes a TrainConfig, not dict: pass config=TrainConfig"):
        await pipeline(model, itertools.count(), play, steps=1, groups_per_step=1, config={"learning_rate": 1e-3})
    with pytest.raises(ConfigError, match="no_such_option"):  # the loss's options, checked as model.train does
        await pipeline(model, itertools.count(), play, steps=1, groups_per_step=1,
                       config=TrainConfig(loss_options={"no_such_option": 1.0}))
    with pytest.raises(LifecycleError, match=r"not registered: call `await model.register\(backend\)`"):
        await pipeline(TrainableModel(name="loose", base_model=tiny_model_dir), itertools.count(), play, steps=1,
                       groups_per_step=1)
    assert started == []

