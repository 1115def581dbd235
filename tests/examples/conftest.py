"""The examples' graphs build ``ChatOpenAI`` with one placeholder ``base_url`` (the adapter routes their calls), so
langchain-openai hands every test the same cached async httpx client (``_cached_async_httpx_client``, an
``lru_cache`` keyed by base URL and timeout). That client's connections belong to the event loop of the test that
first used it; once that loop closes, the next test's rollouts fail with "Event loop is closed" and count as lost
runs, so a smoke test would check less than it says. Each test here gets a fresh client: the cache is emptied
after it (the same reason ``tests/benchmarks/learning.py`` runs each example in a process of its own).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _fresh_langchain_openai_client() -> Iterator[None]:
    yield
    try:
        from langchain_openai.chat_models import _client_utils
    except ImportError:  # a langchain-openai without the cache: nothing is shared between tests
        return
    cached = getattr(_client_utils, "_cached_async_httpx_client", None)
    if cached is not None:
        cached.cache_clear()
