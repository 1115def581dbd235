"""What the LangGraph adapter adds to each LLM call, against the same graph unwrapped.

Both sides run the same compiled graph (one LLM node called ``--calls`` times per run, then END) against
the same gateway and model: unwrapped, its ``ChatOpenAI`` points at the gateway directly; wrapped, it
points nowhere and the adapter routes each call to the rollout's URL, then rebuilds the trajectory from
the gateway's records. Runs alternate between the two sides; each pair's difference, divided by the
calls per run, is one overhead sample, so the machine's drift cancels out. Generation is kept to one
token of a tiny random model so that its noise does not drown the fraction of a millisecond measured.

A third side runs the same graph wrapped with Langfuse on (``trainable(..., langfuse=...)``): the real
``langfuse`` SDK sends to a local receiver standing in for Langfuse (``tests/langfuse_receiver.py``), so
its per-call cost is the rollout trace, the LangChain callback handler's observations, the gateway facts
written onto each LLM observation, and the SDK's background export competing for the same CPU. The receiver
runs in a process of its own, as a Langfuse server would: its decoding of the exported protobuf is the
server's work, not the agent's, and in this process it would take the agent's interpreter lock
(``--receiver-in-process`` puts it back, to compare).

A fourth side runs the wrapped graph with a LangChain callback handler that does nothing: what LangChain
and LangGraph's callback machinery alone costs per call once any handler is attached (run managers, one
callback per node, routing function and LLM call), the floor under Langfuse's ``CallbackHandler``.

With Langfuse on, the extra CPU time of the event loop's thread per call (``overhead_cpu_ms_median_langfuse``,
the same pairing, measured with ``time.thread_time``) is printed too: the part of the overhead that other
processes' load cannot inflate, a cross-check on a shared machine.

Also printed: the cost of the routing decision alone (``Route.rewrite`` on a typical request), in process.

    python tests/benchmarks/capture_overhead.py [--runs 100] [--calls 10]

The four sides are interleaved run by run (the order rotates), so the machine's load hits all of them alike;
each figure is the median of ``--runs`` paired differences (100 by default: about a minute of runs).

Goals: at most 1 ms median per call for the adapter, at most 2 ms with Langfuse on. The last line is a JSON
object with ``overhead_ms_median`` and ``overhead_ms_median_langfuse``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, TypedDict

import torch
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AnyMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from art_core import LocalBackend, TrainableModel
from art_core.models import EMBEDDED_MODEL, resolve_base_model
from art_plugins._routing import Route
from art_plugins.langgraph import trainable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the Langfuse stand-in
from langfuse_receiver import Receiver  # noqa: E402


class NoopHandler(BaseCallbackHandler):
    """A LangChain callback handler that does nothing, called inline (as the Langfuse layer's handler is)."""

    run_inline = True


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    calls: int


def build_graph(base_url: str, calls: int) -> Any:
    llm = ChatOpenAI(model="agent", base_url=base_url, api_key="unused", temperature=0.0, max_tokens=1)

    async def think(state: State) -> dict[str, Any]:
        reply = await llm.ainvoke(state["messages"][:2])  # the same short prompt every time
        return {"messages": [reply], "calls": state.get("calls", 0) + 1}

    builder = StateGraph(State)
    builder.add_node("think", think)
    builder.add_edge(START, "think")
    builder.add_conditional_edges("think", lambda s: "think" if s["calls"] < calls else END)
    return builder.compile()


def tiny_model(folder: Path) -> Path:
    """A 2-layer random Qwen2 with SmolLM2's tokenizer: a real model whose one-token answers take ~ms."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(resolve_base_model(EMBEDDED_MODEL))
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def serve_receiver(conn: Any) -> None:
    """In a process of its own: a Langfuse stand-in; sends its URL, and its span count once told to stop."""
    receiver = Receiver().start()
    conn.send(receiver.url)
    conn.recv()
    with receiver._lock:
        conn.send(len(receiver.spans))
    receiver.close()


class ReceiverProcess:
    """``tests/langfuse_receiver.py``'s receiver in a child process (``url``; ``close()`` returns its span count)."""

    def __init__(self) -> None:
        self._conn, child = multiprocessing.get_context("spawn").Pipe()
        self._process = multiprocessing.get_context("spawn").Process(target=serve_receiver, args=(child,),
                                                                      daemon=True)
        self._process.start()
        self.url = self._conn.recv()

    def close(self) -> int:
        self._conn.send("stop")
        count = int(self._conn.recv())
        self._process.join(10)
        return count


def rewrite_cost_us(repeats: int = 20_000) -> float:
    import httpx2

    route = Route(model_names=frozenset({"agent"}), served_name="agent", base_url="http://127.0.0.1:1/rollouts/r/v1",
                  caller=lambda: "think")
    body = {"model": "agent", "messages": [{"role": "system", "content": "You are terse. " * 20},
                                           {"role": "user", "content": "Say one word."}], "max_tokens": 1}
    request = httpx2.Request("POST", "http://127.0.0.1:9/v1/chat/completions", json=body,
                             headers={"authorization": "Bearer unused"})
    started = time.perf_counter()
    for _ in range(repeats):
        route.rewrite(request)
    return (time.perf_counter() - started) / repeats * 1e6


async def main(runs: int, calls: int, receiver_in_process: bool = False) -> dict[str, float]:
    from langfuse import Langfuse
    from opentelemetry.sdk.trace import TracerProvider

    from art_plugins.langfuse import LangfuseTracing

    torch.set_num_threads(1)
    receiver: Any = Receiver().start() if receiver_in_process else ReceiverProcess()
    with tempfile.TemporaryDirectory() as tmp:
        model = TrainableModel(name="agent", base_model=tiny_model(Path(tmp) / "tiny"))
        async with LocalBackend(path=Path(tmp) / "art", show_progress=False, num_threads=1) as backend:
            await model.register(backend)
            direct = build_graph(model.base_url, calls)
            wrapped = trainable(build_graph("http://127.0.0.1:9/v1", calls), model)
            client = Langfuse(public_key=f"pk-lf-{uuid.uuid4().hex[:8]}", secret_key="sk-lf-bench",
                              base_url=receiver.url, tracer_provider=TracerProvider(shutdown_on_exit=False))
            tracing = LangfuseTracing(client)
            traced = trainable(build_graph("http://127.0.0.1:9/v1", calls), model, langfuse=tracing)
            state = {"messages": [("system", "You are terse. " * 20), ("user", "Say one word.")]}

            async def run_direct() -> float:
                started = time.perf_counter()
                await direct.ainvoke(state)
                return time.perf_counter() - started

            async def run_wrapped() -> float:
                started = time.perf_counter()
                trajectory = await wrapped.rollout(state)
                elapsed = time.perf_counter() - started
                assert len(trajectory.calls) + sum(len(h.calls) for h in trajectory.additional_histories) == calls
                return elapsed

            async def run_traced() -> float:
                started = time.perf_counter()
                trajectory = await traced.rollout(state)
                elapsed = time.perf_counter() - started
                assert trajectory.metadata["langfuse_trace_id"]
                return elapsed

            async def run_callbacks() -> float:
                started = time.perf_counter()
                await wrapped.rollout(state, config={"callbacks": [NoopHandler()]})
                return time.perf_counter() - started

            sides = [run_direct, run_wrapped, run_traced, run_callbacks]
            for _ in range(3):  # warm up every path (clients, template cache, allocator, the SDK's threads)
                for side in sides:
                    await side()
            direct_ms, wrapped_ms, overhead_ms, traced_ms, traced_overhead_ms = [], [], [], [], []
            callbacks_overhead_ms, traced_cpu_ms = [], []
            for i in range(runs):
                # Rotate which side goes first, so none always follows another.
                order = sides[i % len(sides):] + sides[: i % len(sides)]
                took, cpu = {}, {}
                for side in order:
                    cpu_started = time.thread_time()  # this thread's CPU: the agent's loop, gateway and handlers
                    took[side] = await side()
                    cpu[side] = time.thread_time() - cpu_started
                d, w, t = took[run_direct], took[run_wrapped], took[run_traced]
                direct_ms.append(d / calls * 1e3)
                wrapped_ms.append(w / calls * 1e3)
                overhead_ms.append((w - d) / calls * 1e3)
                traced_ms.append(t / calls * 1e3)
                traced_overhead_ms.append((t - d) / calls * 1e3)
                callbacks_overhead_ms.append((took[run_callbacks] - d) / calls * 1e3)
                traced_cpu_ms.append((cpu[run_traced] - cpu[run_direct]) / calls * 1e3)
            await tracing.flush()
            await tracing.aclose()
    spans_received = len(receiver.spans) if receiver_in_process else receiver.close()
    if receiver_in_process:
        receiver.close()
    figures = {
        "calls_measured": runs * calls,
        "direct_ms_per_call_median": round(statistics.median(direct_ms), 3),
        "wrapped_ms_per_call_median": round(statistics.median(wrapped_ms), 3),
        "overhead_ms_median": round(statistics.median(overhead_ms), 3),
        "overhead_ms_p10": round(statistics.quantiles(overhead_ms, n=10)[0], 3),
        "overhead_ms_p90": round(statistics.quantiles(overhead_ms, n=10)[-1], 3),
        "route_rewrite_us": round(rewrite_cost_us(), 1),
        "langfuse_ms_per_call_median": round(statistics.median(traced_ms), 3),
        "overhead_ms_median_langfuse": round(statistics.median(traced_overhead_ms), 3),
        "overhead_ms_p90_langfuse": round(statistics.quantiles(traced_overhead_ms, n=10)[-1], 3),
        "langfuse_spans_received": spans_received,
        "overhead_ms_median_noop_callbacks": round(statistics.median(callbacks_overhead_ms), 3),
        "overhead_cpu_ms_median_langfuse": round(statistics.median(traced_cpu_ms), 3),
    }
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="paired runs (default 100)")
    parser.add_argument("--calls", type=int, default=10, help="LLM calls per run (default 10)")
    parser.add_argument("--receiver-in-process", action="store_true",
                        help="run the Langfuse stand-in in this process (its decoding then competes with the agent)")
    args = parser.parse_args()
    figures = asyncio.run(main(args.runs, args.calls, args.receiver_in_process))
    print(f"{figures['calls_measured']} calls per side: direct {figures['direct_ms_per_call_median']} ms/call, "
          f"wrapped {figures['wrapped_ms_per_call_median']} ms/call")
    print(f"adapter overhead per call: median {figures['overhead_ms_median']} ms "
          f"(p10 {figures['overhead_ms_p10']}, p90 {figures['overhead_ms_p90']}); goal <= 1 ms")
    print(f"with Langfuse on: {figures['langfuse_ms_per_call_median']} ms/call, overhead median "
          f"{figures['overhead_ms_median_langfuse']} ms (p90 {figures['overhead_ms_p90_langfuse']}); goal <= 2 ms; "
          f"{figures['langfuse_spans_received']} spans reached the receiver")
    print(f"  of which the event loop's own thread: {figures['overhead_cpu_ms_median_langfuse']} ms of CPU per call "
          "(median; the SDK's export thread not included)")
    print(f"adapter + a do-nothing LangChain callback handler (the callback machinery's floor): overhead median "
          f"{figures['overhead_ms_median_noop_callbacks']} ms per call")
    print(f"routing decision alone: {figures['route_rewrite_us']} us per request")
    print(json.dumps(figures))
