"""The order `make test`'s two pytest-xdist workers take the modules in: ``slow`` modules first, then the rest.

`make test` runs ``-n 2 --dist loadfile``: each module goes whole to one worker, in the order of the controller's
work queue. pytest-xdist orders that queue by tests per module (``--loadscope-reorder``, its default), so the
learning test, a module of one test that took ~6 minutes then (~2.5 now), started last and ran alone while the
other worker idled (several minutes of the suite). Here the modules with a ``slow`` test start first and the others follow
in xdist's order (most tests first), so the other worker works through them meanwhile.

Why not every module by its measured seconds, longest first: tried, and it paired the heavy modules with each
other (vLLM servers, Ray clusters, README snippets that train), each with processes of its own beyond its
worker's core; they slowed each other down (a README snippet 38 s -> 150 s) and the suite took no less.
"""

from __future__ import annotations

from collections import Counter

import pytest


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def slow_modules_first(items: list[pytest.Item]) -> None:
    """Sort ``items`` in place: modules with a ``slow`` test first, then by their number of tests, most first;
    a module's own tests keep their order (its module-scoped fixtures and file-order tests rely on it), as do
    modules that tie."""
    counts = Counter(module_of(item.nodeid) for item in items)
    slow = {module_of(item.nodeid) for item in items if item.get_closest_marker("slow") is not None}

    def place(item: pytest.Item) -> tuple[bool, int]:
        module = module_of(item.nodeid)
        return module not in slow, -counts[module]

    items.sort(key=place)
