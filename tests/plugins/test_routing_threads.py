"""A rollout's route counts calls made from many threads at once (a graph's synchronous nodes run in parallel)."""

from __future__ import annotations

import threading

import httpx

from art_core.wire import SEED_HEADER
from art_plugins._routing import Route

THREADS, CALLS = 16, 50


def test_calls_from_many_threads_are_each_counted_once_and_seeded_apart():
    route = Route(model_names=frozenset({"agent"}), served_name="agent", base_url="http://127.0.0.1:1/rollouts/r/v1",
                  seed=7)
    start = threading.Barrier(THREADS)  # every thread starts calling at once
    seeds: list[str] = []

    def calls() -> None:
        start.wait()
        for _ in range(CALLS):
            headers = dict(route.call_headers())
            request = httpx.Request("POST", f"{route.base_url}/chat/completions", json={"model": "agent"})
            with route.calling(request):
                assert route.waiting_calls >= 1  # this call, at least, waits for its answer
                b"".join(request.stream)  # the body goes out: delivered
            seeds.append(headers[SEED_HEADER])

    threads = [threading.Thread(target=calls) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    total = THREADS * CALLS
    assert len(seeds) == total and len(set(seeds)) == total  # no two calls took the same position
    assert route.routed_calls == route.delivered_calls == total and route.waiting_calls == 0
    assert route.calls_to_record == total
