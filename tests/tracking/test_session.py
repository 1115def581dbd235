"""``report_to`` itself: checked at construction, importing nothing when off, and a failing tracker never
failing a step (failures counted, one warning per step)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest
from tracked_steps import train_steps

from art_core import ConfigError, LocalBackend, TrainableModel
from art_core.tracking import TRACKER_NAMES, RunInfo, StepReport, TensorBoardTracker, TrackingSession, resolve_trackers

TRACKER_MODULES = ("wandb", "mlflow", "tensorboard", "trackio")


class Recording:
    """A user's own tracker (the ``Tracker`` protocol): keeps what it is given."""

    def __init__(self, name: str = "recording") -> None:
        self.name = name
        self.runs: list[RunInfo] = []
        self.reports: list[StepReport] = []
        self.finished = 0

    def start(self, run: RunInfo) -> str:
        self.runs.append(run)
        return run.run_id or "run-1"

    def log_step(self, report: StepReport) -> None:
        self.reports.append(report)

    def finish(self) -> None:
        self.finished += 1


class Broken(Recording):
    """A tracker whose service is down: ``log_step`` always raises, ``start`` raises the first time."""

    def start(self, run: RunInfo) -> str:
        if not self.runs:
            self.runs.append(run)
            raise ConnectionError("tracking server unreachable")
        return super().start(run)

    def log_step(self, report: StepReport) -> None:
        raise ConnectionError("tracking server unreachable")


def test_report_to_off_imports_no_tracker_library_even_through_a_step(tiny_model_dir, tmp_path):
    script = textwrap.dedent("""
        import asyncio, json, sys
        from art_core import LocalBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup

        async def main():
            model = TrainableModel(name="quiet", base_model=sys.argv[1])
            # Naming trackers checks their packages exist without importing them.
            TrainableModel(name="named", report_to=["wandb", "mlflow", "tensorboard", "trackio"])
            async with LocalBackend(path=sys.argv[2], serve=False, show_progress=False) as backend:
                await model.register(backend)
                group = TrajectoryGroup([Trajectory(messages=[{"role": "user", "content": "hi"},
                                                              {"role": "assistant", "content": "hello"}], reward=r)
                                         for r in (0.0, 1.0)])
                await model.train([group], config=TrainConfig(learning_rate=1e-3))
            print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} | {m for m in sys.modules
                                                                              if m.startswith("art_core.tracking")})))
        asyncio.run(main())
    """)
    done = subprocess.run([sys.executable, "-c", script, str(tiny_model_dir), str(tmp_path)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert "torch" in loaded  # the step ran
    assert loaded & set(TRACKER_MODULES) == set()
    assert {m for m in loaded if m.startswith("art_core.tracking.")} <= {"art_core.tracking._base",
        "art_core.tracking._mlflow", "art_core.tracking._report", "art_core.tracking._session",
        "art_core.tracking._tensorboard", "art_core.tracking._trackio", "art_core.tracking._wandb"}


def test_report_to_all_names_each_installed_tracker_and_refuses_when_none_is(monkeypatch):
    assert [t.name for t in resolve_trackers("all")] == list(TRACKER_NAMES)  # the four are installed here
    monkeypatch.setitem(sys.modules, "trackio", None)  # as on a machine without it: find_spec finds nothing
    assert [t.name for t in resolve_trackers(["all"])] == ["wandb", "mlflow", "tensorboard"]  # as --report-to all
    for name in TRACKER_NAMES:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError, match=r"report_to='all' found none of the tracker packages installed"):
        TrainableModel(name="none-installed", report_to="all")


@pytest.mark.parametrize(("report_to", "message"), [
    ("comet", "unknown tracker 'comet'"),
    (["all", "tensorboard"], "lists 'all' beside other trackers: give 'all' alone"),
    (["tensorboard", 3], "report_to got int"),
    (42, "report_to got int"),  # a single object that is not a tracker: not iterated
    (TensorBoardTracker, r"got the class TensorBoardTracker, not a tracker: pass an instance, TensorBoardTracker\(...\)"),
    ([TensorBoardTracker], "got the class TensorBoardTracker"),
    (["tensorboard", TensorBoardTracker()], "two trackers named 'tensorboard'"),
])
def test_bad_report_to_is_refused_when_the_model_is_made(report_to, message):
    with pytest.raises(ConfigError, match=message):
        TrainableModel(name="bad", report_to=report_to)


def test_a_tracker_whose_package_is_missing_is_refused_with_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "trackio", None)  # as on a machine without it: find_spec finds nothing
    with pytest.raises(ConfigError, match=r"pip install 'art-core\[trackio\]'"):
        TrainableModel(name="missing", report_to=["tensorboard", "trackio"])


async def test_a_failing_tracker_never_fails_a_step_and_is_warned_about_once_per_step(tiny_model_dir, tmp_path,
                                                                                       caplog):
    good, broken = Recording(), Broken("broken")
    model = TrainableModel(name="mixed", base_model=tiny_model_dir, report_to=[broken, good])
    async with LocalBackend(path=tmp_path, serve=False, show_progress=False) as backend:
        await model.register(backend)
        with caplog.at_level(logging.WARNING, logger="art_core.tracking"):
            await train_steps(model, 2)
        await model.finish_tracking()
    assert model.step == 2

    warnings = [r.getMessage() for r in caplog.records if r.name == "art_core.tracking"]
    assert len(warnings) == 2  # one per step, naming every failure of that step
    assert warnings[0].startswith("tracking, step 1: 1 tracker call(s) failed")  # start failed: no log_step
    assert "broken.start failed: ConnectionError: tracking server unreachable" in warnings[0]
    assert warnings[1].startswith("tracking, step 2: 1 tracker call(s) failed")  # started, then log_step failed
    assert "broken.log_step failed" in warnings[1]
    assert model.tracking is not None and model.tracking.failures == 2

    assert [r.step for r in good.reports] == [1, 2]
    # Failures before the report went out: step 1's failed start, then (step 2) nothing new before log_step.
    assert [r.metrics["tracking/failures"] for r in good.reports] == [1.0, 1.0]
    assert good.finished == 1 and broken.finished == 1
    ids = json.loads((tmp_path / "default" / "models" / "mixed" / "tracking" / "runs.json").read_text())
    assert ids == {"broken": "run-1", "recording": "run-1"}
    (run,) = good.runs
    assert run.config["model"] == "mixed" and run.config["lora"]["rank"] == 8
    assert run.config["train"]["learning_rate"] == 1e-3


def test_a_tracker_that_keeps_failing_to_start_is_tried_again_after_1_2_4_8_steps(tmp_path):
    """A start that fails slowly (a tracking server down: MLflow's client retries for minutes) held up every step's
    report when tried at every step; it is tried again after 1, 2, 4 ... steps."""
    attempts: list[int] = []

    class Down(Recording):
        def start(self, run: RunInfo) -> str:
            attempts.append(len(good.reports) + 1)  # the report being given
            raise ConnectionError("tracking server unreachable")

    good = Recording()
    session = TrackingSession([Down("down"), good], tmp_path)
    for step in range(1, 17):
        session.report(step=step, metrics={"loss": 0.0}, groups=[], config={}, project="p", name="n", seconds={})
    assert attempts == [1, 2, 4, 8, 16] and [r.step for r in good.reports] == list(range(1, 17))
    assert session.failures == 5


async def test_report_has_the_steps_numbers_and_its_best_and_worst_trajectories(tiny_model_dir, tmp_path):
    good = Recording()
    model = TrainableModel(name="numbers", base_model=tiny_model_dir, report_to=good)
    async with LocalBackend(path=tmp_path, serve=False, show_progress=False) as backend:
        await model.register(backend)
        (metrics,) = await train_steps(model, 1)
        await model.finish_tracking()  # the report is sent in the background: this waits for it
    (report,) = good.reports
    assert report.metrics["train/reward_mean"] == metrics["reward_mean"] == 0.4375
    assert report.metrics["train/reward_std"] == pytest.approx(0.3697, abs=1e-4)  # population std of 0,1,.5,.25
    assert report.metrics["rollout/success_mean"] == 0.25
    assert report.metrics["train/loss"] == metrics["loss"]
    assert report.metrics["time/forward_backward"] == metrics["seconds_forward_backward"]
    assert "train/seconds_total" not in report.metrics
    best, worst = report.trajectories
    assert (best.label, best.reward, best.group, best.trace_id) == ("best", 1.0, 0, "trace-1")
    assert (worst.label, worst.reward, worst.trace_id) == ("worst", 0.0, None)
    assert best.messages.startswith("user: Name a color.\n\nassistant: ")
