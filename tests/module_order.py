"""Longest test modules first, so that `make test`'s two pytest-xdist workers finish together.

`make test` runs ``-n 2 --dist loadfile``: each module goes whole to one worker, in the order of the controller's
work queue. pytest-xdist orders that queue by tests per module (``--loadscope-reorder``, its default), so a
module of one long test started last: the learning test (~6 minutes, one test) ran alone at the end while the
other worker idled, about 3 of the suite's 20 minutes. Ordering modules by their measured seconds instead
(longest first, a greedy schedule's best order) brought the two workers level (``tests/module_seconds.json``).

The table only orders the work; no test reads it. A module it does not know yet is placed as a module of that
many tests of the table's mean length. Refresh it after adding or slowing a module:

    .venv/bin/python -m pytest -n 2 --dist loadfile --write-module-seconds tests/module_seconds.json

(a run with the vLLM venv and everything else `make test` sets up, so that no module is skipped).
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from pathlib import Path

import pytest

MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")
"""``{module path: seconds}``: setup, call and teardown of its tests, summed over one full run."""


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def in_xdist_worker() -> bool:
    return "PYTEST_XDIST_WORKER" in os.environ


def load_seconds(path: Path = MODULE_SECONDS) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except FileNotFoundError:
        return {}


def longest_modules_first(items: list[pytest.Item], seconds: dict[str, float]) -> None:
    """Sort ``items`` in place by their module's expected seconds, longest first; a module's own tests keep
    their order (its module-scoped fixtures and file-order tests rely on it), as do modules of equal estimate."""
    counts = Counter(module_of(item.nodeid) for item in items)
    known = [module for module in counts if module in seconds]
    per_test = sum(seconds[m] for m in known) / sum(counts[m] for m in known) if known else 1.0

    def expected(module: str) -> float:
        return seconds.get(module, counts[module] * per_test)

    items.sort(key=lambda item: -expected(module_of(item.nodeid)))


class SecondsRecorder:
    """Sums each module's test seconds (every phase) as the reports come in, and writes the table at the end.

    Under xdist the controller receives every worker's reports, so only it records."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[module_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self) -> None:
        table = {module: round(s, 1) for module, s in sorted(self.seconds.items())}
        self.path.write_text(json.dumps(table, indent=1) + "\n")
