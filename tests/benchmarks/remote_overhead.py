"""What the remote path (RemoteBackend -> `art-core serve`) adds against LocalBackend, measured side by side.

Two figures, each from paired runs that alternate between the two sides so the machine's drift cancels:

- ``train_overhead_s``: one train call of 4 groups x 8 trajectories (one call each: 256 prompt tokens, 64
  completion tokens, logprobs). Local: ``LocalBackend.train`` in this process. Remote: the same groups to a
  server on 127.0.0.1 (JSON body, trajectories persisted, SSE progress, result). Both train the same tiny
  model on 1 thread, so the difference is the remote path's own cost. Goal: at most 0.5 s.
- ``rollout_overhead_ms``: per LLM call of a LangGraph rollout (``--calls`` calls of a one-node graph, then
  the trajectory rebuilt from the gateway's records), through the adapter. Local: the model's gateway on
  its own port in this process. Remote: the server's gateway, mounted on its one port behind the token,
  records fetched over HTTP. One-token answers of a tiny random model keep generation out of the way.
  Goal: at most 2 ms.
- ``server_layers_us``: what the server's own layers (token check, body rules, dispatch to the mounted
  gateway) add to one request, in process (``httpx.ASGITransport``, no sockets, no second process):
  ``GET .../v1/models`` through the server's app against the same request to the gateway's app directly.
  It separates the code's cost from what two processes cost on a busy machine (scheduling, loopback).

    python tests/benchmarks/remote_overhead.py [--train-pairs 5] [--runs 20] [--calls 10]

The last line is a JSON object of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from art_core import CallRecord, LocalBackend, RemoteBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
from art_plugins.langgraph import trainable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capture_overhead import build_graph, tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOKEN = "bench-token-0123456789abcdef"


def groups(seed: int) -> list[TrajectoryGroup]:
    rng = random.Random(seed)
    out = []
    for _ in range(4):
        prompt = [rng.randrange(100, 40000) for _ in range(256)]
        out.append(TrajectoryGroup(Trajectory(
            messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            calls=[CallRecord(prompt_token_ids=prompt, completion_token_ids=[rng.randrange(100, 40000) for _ in range(64)],
                              logprobs=[-rng.random() for _ in range(64)])],
            reward=rng.random()) for _ in range(8)))
    return out


def start_server(path: Path) -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "core"), str(REPO)]))
    process = subprocess.Popen([sys.executable, "-m", "art_core.cli", "serve", "--port", "0", "--token", TOKEN,
                                "--path", str(path), "--threads", "1"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("ART_SERVER_URL="):
            return process, line.split("=", 1)[1].strip()
    raise RuntimeError("the server did not start")


async def layers_us(base: Path, folder: Path, requests: int = 2000) -> float:
    """Median over 5 alternated rounds of (server app - gateway app) per request, in microseconds."""
    import httpx

    from art_core.server.app import create_server_app

    backend = LocalBackend(path=folder, show_progress=False, num_threads=1,
                           gateway_mount=lambda spec: f"http://server/gateway/{spec.project}/{spec.name}")
    async with backend:
        model = TrainableModel(name="agent", base_model=base)
        app = create_server_app(backend, token=TOKEN, max_body_bytes=1 << 20)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        through = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server",
                                    headers=headers)
        registered = await through.post("/art/v1/models", content=model.spec.model_dump_json())
        assert registered.status_code == 200, registered.text
        direct = httpx.AsyncClient(transport=httpx.ASGITransport(app=backend.gateway(model.spec).app),
                                   base_url="http://server")

        async def timed(client: httpx.AsyncClient, path: str) -> float:
            started = time.perf_counter()
            for _ in range(requests):
                response = await client.get(path)
                assert response.status_code == 200, response.text
            return (time.perf_counter() - started) / requests

        differences = []
        for _ in range(6):
            d = await timed(direct, "/v1/models")
            t = await timed(through, "/gateway/default/agent/v1/models")
            differences.append((t - d) * 1e6)
        await through.aclose()
        await direct.aclose()
    return statistics.median(differences[1:])  # the first round warms up


async def main(train_pairs: int, runs: int, calls: int) -> dict[str, float]:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        base = tiny_model(Path(tmp) / "tiny")
        process, url = start_server(Path(tmp) / "server")
        try:
            async with LocalBackend(path=Path(tmp) / "local", show_progress=False, num_threads=1) as local, \
                    RemoteBackend(url, token=TOKEN, show_progress=False) as remote:
                here = TrainableModel(name="agent", base_model=base)
                there = TrainableModel(name="agent", base_model=base)
                await here.register(local)
                await there.register(remote)
                config = TrainConfig(learning_rate=1e-4)

                # -- train calls -------------------------------------------------------------------------
                async def timed_train(model: TrainableModel, data: list[TrajectoryGroup]) -> float:
                    started = time.perf_counter()
                    metrics = await model.train(data, config=config)
                    assert metrics["trained"]
                    return time.perf_counter() - started

                await timed_train(here, groups(-1))  # warm up both (allocator, optimizer state, connections)
                await timed_train(there, groups(-1))
                local_s, remote_s, train_overhead = [], [], []
                for i in range(train_pairs):
                    data = groups(i)
                    if i % 2:
                        lo, re = await timed_train(here, data), await timed_train(there, data)
                    else:
                        re, lo = await timed_train(there, data), await timed_train(here, data)
                    local_s.append(lo)
                    remote_s.append(re)
                    train_overhead.append(re - lo)
                body_bytes = sum(len(g.model_dump_json()) for g in groups(0))

                # -- LangGraph rollouts ------------------------------------------------------------------
                local_graph = trainable(build_graph("http://127.0.0.1:9/v1", calls), here)
                remote_graph = trainable(build_graph("http://127.0.0.1:9/v1", calls), there)
                state = {"messages": [("system", "You are terse. " * 20), ("user", "Say one word.")]}

                async def timed_rollout(graph) -> float:  # noqa: ANN001
                    started = time.perf_counter()
                    trajectory = await graph.rollout(state)
                    elapsed = time.perf_counter() - started
                    last_rollout[graph] = trajectory.metadata["rollout_id"]
                    assert len(trajectory.calls) + sum(len(h.calls) for h in trajectory.additional_histories) == calls
                    return elapsed

                last_rollout: dict[object, str] = {}
                for _ in range(3):
                    await timed_rollout(local_graph)
                    await timed_rollout(remote_graph)
                local_ms, remote_ms, rollout_overhead = [], [], []
                for i in range(runs):
                    if i % 2:
                        lo, re = await timed_rollout(local_graph), await timed_rollout(remote_graph)
                    else:
                        re, lo = await timed_rollout(remote_graph), await timed_rollout(local_graph)
                    local_ms.append(lo / calls * 1e3)
                    remote_ms.append(re / calls * 1e3)
                    rollout_overhead.append((re - lo) / calls * 1e3)
                # Part of the rollout's cost: fetching its records (one GET per rollout, awaited on the loop).
                fetch_ms = []
                for _ in range(20):
                    started = time.perf_counter()
                    assert len(await there.fetch_rollout_records(last_rollout[remote_graph])) == calls
                    fetch_ms.append((time.perf_counter() - started) * 1e3)
        finally:
            process.terminate()
            process.wait(60)
        layers = await layers_us(base, Path(tmp) / "layers")
    return {
        "train_pairs": train_pairs,
        "train_body_bytes": body_bytes,
        "train_local_s_median": round(statistics.median(local_s), 3),
        "train_remote_s_median": round(statistics.median(remote_s), 3),
        "train_overhead_s": round(statistics.median(train_overhead), 3),
        "rollout_calls_measured": runs * calls,
        "rollout_local_ms_per_call_median": round(statistics.median(local_ms), 3),
        "rollout_remote_ms_per_call_median": round(statistics.median(remote_ms), 3),
        "rollout_overhead_ms": round(statistics.median(rollout_overhead), 3),
        "rollout_overhead_ms_p90": round(statistics.quantiles(rollout_overhead, n=10)[-1], 3),
        "records_fetch_ms_median": round(statistics.median(fetch_ms), 3),
        "server_layers_us": round(layers, 1),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-pairs", type=int, default=5, help="paired train calls (default 5)")
    parser.add_argument("--runs", type=int, default=20, help="paired LangGraph rollouts (default 20)")
    parser.add_argument("--calls", type=int, default=10, help="LLM calls per rollout (default 10)")
    args = parser.parse_args()
    figures = asyncio.run(main(args.train_pairs, args.runs, args.calls))
    print(f"train call, 4 groups x 8 trajectories ({figures['train_body_bytes']} bytes of JSON): local "
          f"{figures['train_local_s_median']} s, remote {figures['train_remote_s_median']} s; overhead "
          f"{figures['train_overhead_s']} s (goal <= 0.5 s)")
    print(f"LangGraph rollout, per LLM call: local {figures['rollout_local_ms_per_call_median']} ms, remote "
          f"{figures['rollout_remote_ms_per_call_median']} ms; overhead {figures['rollout_overhead_ms']} ms "
          f"(p90 {figures['rollout_overhead_ms_p90']}; goal <= 2 ms)")
    print(f"of which fetching a rollout's {args.calls} records: {figures['records_fetch_ms_median']} ms per rollout")
    print(f"server layers (token, body rules, dispatch), in process: {figures['server_layers_us']} us per request")
    print(json.dumps(figures))
