"""The suite's own scheduling aid (``tests/module_order.py``): slow modules first, each module's tests in order."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

import module_order


@dataclass
class Item:
    """Stands in for a collected ``pytest.Item``: the ordering reads its ``nodeid`` and its markers only."""

    nodeid: str
    markers: list[str] = field(default_factory=list)

    def get_closest_marker(self, name: str) -> pytest.Mark | None:
        return getattr(pytest.mark, name).mark if name in self.markers else None


def test_slow_modules_go_first_then_the_most_tests_and_each_module_keeps_its_order():
    items = [Item("tests/a.py::one"), Item("tests/a.py::two"), Item("tests/b.py::one"),
             Item("tests/c.py::one"), Item("tests/c.py::two"), Item("tests/c.py::three"),
             Item("tests/learn.py::one", ["slow"]), Item("tests/d.py::one"), Item("tests/d.py::two", ["slow"])]
    module_order.slow_modules_first(items)
    assert [i.nodeid for i in items] == ["tests/d.py::one", "tests/d.py::two", "tests/learn.py::one",
                                         "tests/c.py::one", "tests/c.py::two", "tests/c.py::three",
                                         "tests/a.py::one", "tests/a.py::two", "tests/b.py::one"]
