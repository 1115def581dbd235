"""The module-scoped server of tests/server (helpers in server_process.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_process import Server, running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("server")) as running:
        yield running
