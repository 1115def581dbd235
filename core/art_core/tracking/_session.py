"""The trackers of one ``TrainableModel``: which ones (``report_to``), their run ids on disk, and failures.

Every call into a tracker goes through ``TrackingSession``, which catches what a tracker raises: a failure is
counted, the step goes on, and one warning per step names every tracker that failed in it.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import logging
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias

from ..errors import ConfigError
from ..types import TrajectoryGroup
from ._base import RunInfo, Tracker
from ._report import step_report

__all__ = ["TRACKER_NAMES", "ReportTo", "TrackingSession", "resolve_trackers"]

logger = logging.getLogger("art_core.tracking")

_FAILED = object()  # what _call returns for a call that raised (None may be a tracker's real answer)

ReportTo: TypeAlias = "str | Tracker | Sequence[str | Tracker] | None"
"""A tracker name, a tracker object, or a list of them; None or ``"none"`` for none."""


def _wandb() -> Tracker:
    from ._wandb import WandbTracker

    return WandbTracker()


def _mlflow() -> Tracker:
    from ._mlflow import MLflowTracker

    return MLflowTracker()


def _tensorboard() -> Tracker:
    from ._tensorboard import TensorBoardTracker

    return TensorBoardTracker()


def _trackio() -> Tracker:
    from ._trackio import TrackioTracker

    return TrackioTracker()


_BUILDERS: dict[str, Callable[[], Tracker]] = {
    "wandb": _wandb, "mlflow": _mlflow, "tensorboard": _tensorboard, "trackio": _trackio,
}
TRACKER_NAMES = tuple(_BUILDERS)
"""The names ``report_to`` takes (TRL's names for the same tools)."""


def resolve_trackers(report_to: Any) -> list[Tracker]:
    """The tracker objects ``report_to`` names, checked before any work starts (no library is imported).

    Raises:
        ConfigError: an unknown name, something that is not a tracker, or two trackers with one name.

    ``"all"`` (or ``["all"]``) names every tracker whose package is installed, as TRL's ``report_to="all"`` does.
    """
    if report_to is None or report_to == "none":
        return []
    if report_to == "all" or (isinstance(report_to, list | tuple) and list(report_to) == ["all"]):  # as TRL's
        report_to = [name for name in TRACKER_NAMES if importlib.util.find_spec(name) is not None]
        if not report_to:
            raise ConfigError("report_to='all' found none of the tracker packages installed "
                              f"({', '.join(TRACKER_NAMES)}): pip install 'art-core[trackers]', or name the "
                              "trackers you want")
    single = isinstance(report_to, str | type) or not isinstance(report_to, list | tuple | set | frozenset)
    items = [report_to] if single else list(report_to)
    trackers: list[Tracker] = []
    for item in items:
        if isinstance(item, type):  # the class itself passes the protocol's attribute check; its methods want self
            raise ConfigError(f"report_to got the class {item.__name__}, not a tracker: pass an instance, "
                              f"{item.__name__}(...)")
        if isinstance(item, str):
            if item == "all":
                raise ConfigError("report_to lists 'all' beside other trackers: give 'all' alone (each tracker "
                                  "installed) or name each tracker")
            if item not in _BUILDERS:
                raise ConfigError(f"report_to names an unknown tracker {item!r}: use one of "
                                  f"{', '.join(TRACKER_NAMES)}, a list of them, or a Tracker object")
            if importlib.util.find_spec(item) is None:  # found without importing it: nothing loads until a step
                raise ConfigError(f"report_to={item!r} needs the {item} package, which is not installed: "
                                  f"pip install 'art-core[{item}]' (or 'art-core[trackers]' for all four)")
            trackers.append(_BUILDERS[item]())
        elif isinstance(item, Tracker):
            trackers.append(item)
        else:
            raise ConfigError(f"report_to got {type(item).__name__}: give tracker names ({', '.join(TRACKER_NAMES)}) "
                              "or objects with name, start, log_step and finish (art_core.tracking.Tracker)")
    names = [t.name for t in trackers]
    if len(set(names)) != len(names):
        raise ConfigError(f"report_to has two trackers named {sorted(n for n in names if names.count(n) > 1)[0]!r}: "
                          "each tracker's run id is kept under its name, so give each a distinct name")
    return trackers


class TrackingSession:
    """Fans a model's steps out to its trackers; runs them in order, never raising.

    Its calls run on one worker thread of its own (``submit``), so reports are sent in order and a step need not
    wait for the trackers' I/O. Python joins that thread at exit: a report still being sent is finished first.

    Args:
        trackers: from ``resolve_trackers``.
        folder: where ``runs.json`` (the run ids) and the trackers' local files live.
    """

    def __init__(self, trackers: Sequence[Tracker], folder: Path) -> None:
        self.trackers = list(trackers)
        self.folder = folder
        self.failures = 0
        """Tracker calls that raised, since the model was made."""
        self._started: list[Tracker] = []
        self._config: dict[str, Any] | None = None  # the config the trackers last got (in start or a report)
        self._reports = 0  # reports given so far
        self._retry: dict[int, tuple[int, int]] = {}
        """A tracker whose start failed (by id): (the report at which to try again, the failed starts so far)."""
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="art-tracking")

    def submit(self, call: Callable[[], None]) -> concurrent.futures.Future[None]:
        """Run ``call`` (``report`` or ``finish``) on the session's worker thread, after those submitted before."""
        return self._worker.submit(call)

    @property
    def state_path(self) -> Path:
        """``runs.json``: ``{tracker name: run id}``, so a resumed model continues its runs."""
        return self.folder / "runs.json"

    def report(self, *, step: int, metrics: Mapping[str, Any], groups: Sequence[TrajectoryGroup],
               config: dict[str, Any], project: str, name: str, seconds: Mapping[str, float]) -> None:
        """Start the trackers not started yet, then give each the step's report (a blocking call: run it in a
        worker thread). Failures are counted, and warned about once for the step."""
        problems: list[str] = []
        self._reports += 1
        try:
            for tracker in self.trackers:
                if tracker not in self._started and self._reports >= self._retry.get(id(tracker), (0, 0))[0]:
                    self._start(tracker, RunInfo(project=project, name=name, folder=self.folder, config=config,
                                                 run_id=self._run_ids().get(tracker.name)), problems)
            # A tracker started above got the config in start; the others get it in the report when it changed.
            changed = self._config is not None and config != self._config
            self._config = config
            report = step_report(step, metrics, groups, seconds=seconds, failures=self.failures,
                                 config=config if changed else None)
            for tracker in self._started:
                self._call(tracker, "log_step", lambda t=tracker: t.log_step(report), problems)
        except Exception as exc:  # our own part (the report, runs.json) must not fail the step either
            self.failures += 1
            problems.append(f"tracking failed: {type(exc).__name__}: {str(exc)[:300]}")
        self._warn(step, problems)

    def finish(self) -> None:
        """Finish every started tracker's run; the next ``report`` starts (resumes) them again."""
        problems: list[str] = []
        for tracker in self._started:
            self._call(tracker, "finish", tracker.finish, problems)
        self._started = []
        if problems:
            logger.warning("tracking: %s", "; ".join(problems))

    def _start(self, tracker: Tracker, run: RunInfo, problems: list[str]) -> None:
        run_id = self._call(tracker, "start", lambda: tracker.start(run), problems)
        if run_id is _FAILED:
            # Not started: a later step tries again, after 1, 2, 4 ... 64 steps, so that a start that fails slowly (a
            # server down: MLflow's client retries for minutes) does not hold up every step's report behind it.
            failed = self._retry.get(id(tracker), (0, 0))[1] + 1
            self._retry[id(tracker)] = (self._reports + min(2 ** (failed - 1), 64), failed)
            problems[-1] += f" (tried again in {min(2 ** (failed - 1), 64)} step(s))"
            return
        self._retry.pop(id(tracker), None)
        self._started.append(tracker)
        if run_id is not None and run_id != run.run_id:
            self._save_run_id(tracker.name, str(run_id))

    def _call(self, tracker: Tracker, what: str, call: Callable[[], Any], problems: list[str]) -> Any:
        try:
            return call()
        except Exception as exc:  # a tracker must not fail the step: the checkpoint is on disk already
            self.failures += 1
            problems.append(f"{tracker.name}.{what} failed: {type(exc).__name__}: {str(exc)[:300]}")
            logger.debug("tracker %s.%s failed", tracker.name, what, exc_info=True)
            return _FAILED

    def _warn(self, step: int, problems: list[str]) -> None:
        if problems:
            logger.warning("tracking, step %d: %d tracker call(s) failed (%d in all): %s", step, len(problems),
                           self.failures, "; ".join(problems))

    def _run_ids(self) -> dict[str, str]:
        try:
            return dict(json.loads(self.state_path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:  # unreadable: start new runs rather than fail the step
            logger.warning("tracking: cannot read %s (%s); the trackers start new runs", self.state_path, exc)
            return {}

    def _save_run_id(self, name: str, run_id: str) -> None:
        # Atomic (temporary file + rename): a crash mid-write must not lose the other trackers' ids.
        ids = {**self._run_ids(), name: run_id}
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_name(f".tracking.{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_text(json.dumps(ids, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, self.state_path)
