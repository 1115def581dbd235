"""What showing graph states compactly saves per LLM call with Langfuse on, measured side by side.

Three sides, run in rotation in one process against the same gateway and tiny model as
``capture_overhead.py`` (one LLM node called ``--calls`` times per run): the graph unwrapped (direct), the
graph with Langfuse on and Langfuse's LangChain ``CallbackHandler`` as shipped, and the graph with Langfuse
on and art-plugins' handler (the same handler, with the state's LangChain messages given to the SDK in the
compact form of its generations). The two traced sides differ only in the handler class, which is swapped
through the tracing's handler class (``LangfuseTracing._handler_type``) between runs. Each run's
overhead is its time minus the direct run's of the same round, per call; the saving is the paired difference.

    python tests/benchmarks/langfuse_state_compaction.py [--runs 60] [--calls 10]

The last line is a JSON object with ``overhead_ms_median_plain_handler``, ``overhead_ms_median_compact`` and
``saving_ms_median``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the Langfuse stand-in
from capture_overhead import build_graph, tiny_model  # noqa: E402
from langfuse_receiver import Receiver  # noqa: E402

from art_core import LocalBackend, TrainableModel  # noqa: E402
from art_plugins.langgraph import trainable  # noqa: E402


async def main(runs: int, calls: int) -> dict[str, float]:
    from langfuse import Langfuse
    from langfuse.langchain import CallbackHandler
    from opentelemetry.sdk.trace import TracerProvider

    import art_plugins.langfuse as art_langfuse

    torch.set_num_threads(1)
    receiver = Receiver().start()
    with tempfile.TemporaryDirectory() as tmp:
        model = TrainableModel(name="agent", base_model=tiny_model(Path(tmp) / "tiny"))
        async with LocalBackend(path=Path(tmp) / "art", show_progress=False, num_threads=1) as backend:
            await model.register(backend)
            client = Langfuse(public_key=f"pk-lf-{uuid.uuid4().hex[:8]}", secret_key="sk-lf-bench",
                              base_url=receiver.url, tracer_provider=TracerProvider(shutdown_on_exit=False))
            tracing = art_langfuse.LangfuseTracing(client)
            direct = build_graph(model.base_url, calls)
            traced = trainable(build_graph("http://127.0.0.1:9/v1", calls), model, langfuse=tracing)
            compact = tracing.langchain_handler_type()
            state = {"messages": [("system", "You are terse. " * 20), ("user", "Say one word.")]}

            async def run_direct() -> float:
                started = time.perf_counter()
                await direct.ainvoke(state)
                return time.perf_counter() - started

            async def traced_with(handler: type) -> float:
                tracing._handler_type = handler
                started = time.perf_counter()
                await traced.rollout(state)
                return time.perf_counter() - started

            async def run_plain() -> float:
                return await traced_with(CallbackHandler)

            async def run_compact() -> float:
                return await traced_with(compact)

            sides = [run_direct, run_plain, run_compact]
            for _ in range(3):
                for side in sides:
                    await side()
            plain_ms, compact_ms, saving_ms = [], [], []
            for i in range(runs):
                order = sides[i % len(sides):] + sides[: i % len(sides)]
                took = {side: await side() for side in order}
                plain_ms.append((took[run_plain] - took[run_direct]) / calls * 1e3)
                compact_ms.append((took[run_compact] - took[run_direct]) / calls * 1e3)
                saving_ms.append((took[run_plain] - took[run_compact]) / calls * 1e3)
            tracing._handler_type = compact
            await tracing.flush()
            await tracing.aclose()
    receiver.close()
    return {"calls_measured": runs * calls,
            "overhead_ms_median_plain_handler": round(statistics.median(plain_ms), 3),
            "overhead_ms_median_compact": round(statistics.median(compact_ms), 3),
            "saving_ms_median": round(statistics.median(saving_ms), 3),
            "saving_ms_p10": round(statistics.quantiles(saving_ms, n=10)[0], 3),
            "saving_ms_p90": round(statistics.quantiles(saving_ms, n=10)[-1], 3)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=60, help="rounds of the three sides (default 60)")
    parser.add_argument("--calls", type=int, default=10, help="LLM calls per run (default 10)")
    args = parser.parse_args()
    figures = asyncio.run(main(args.runs, args.calls))
    print(f"Langfuse overhead per call: Langfuse's handler {figures['overhead_ms_median_plain_handler']} ms, "
          f"compact states {figures['overhead_ms_median_compact']} ms; paired saving median "
          f"{figures['saving_ms_median']} ms (p10 {figures['saving_ms_p10']}, p90 {figures['saving_ms_p90']})")
    print(json.dumps(figures))
