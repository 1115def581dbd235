"""The suite's own scheduling aid (``tests/module_order.py``): longest modules first, each module's tests in order."""

from __future__ import annotations

import json
from dataclasses import dataclass

import module_order


@dataclass
class Item:
    """Stands in for a collected ``pytest.Item``: the ordering reads nothing but ``nodeid``."""

    nodeid: str


def test_modules_go_longest_first_and_keep_their_own_order():
    items = [Item(n) for n in ("tests/a.py::one", "tests/a.py::two", "tests/b.py::one", "tests/c.py::one",
                               "tests/c.py::two", "tests/c.py::three", "tests/new.py::one", "tests/new.py::two")]
    # Known: a 2 tests in 4 s, b 1 in 300 s, c 3 in 6 s: 310 s over 6 tests, so the unknown module's 2 tests
    # count as ~103 s, between b and c.
    module_order.longest_modules_first(items, {"tests/a.py": 4.0, "tests/b.py": 300.0, "tests/c.py": 6.0})
    assert [i.nodeid for i in items] == ["tests/b.py::one", "tests/new.py::one", "tests/new.py::two",
                                         "tests/c.py::one", "tests/c.py::two", "tests/c.py::three",
                                         "tests/a.py::one", "tests/a.py::two"]


def test_the_checked_in_table_names_modules_that_exist(pytestconfig):
    # A renamed or deleted module left in the table would only mis-order the run; this keeps the table honest.
    table = json.loads(module_order.MODULE_SECONDS.read_text())
    missing = [m for m in table if not (pytestconfig.rootpath / m).is_file()]
    assert not missing, (f"tests/module_seconds.json names modules that are gone: {missing} (refresh it: "
                         "tests/module_order.py says how)")
