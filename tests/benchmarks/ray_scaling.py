"""RayBackend scaling on this machine: rollout throughput with 1 vs 2 engine replicas, step time with 1 vs 2
trainer ranks, side by side in one run.

One local Ray instance (temp files under the run's folder). Each replica and each rank is held to one torch
thread (``num_threads=1``) so that, on a 2-core machine, each has a core of its own. Model: the embedded
SmolLM2-135M-Instruct on CPU (fp32).

- rollouts: ``--rollouts`` one-call chat rollouts (a prompt of about ``--prompt-words`` words,
  ``--max-tokens`` sampled tokens) on 8 rollout workers through the one gateway, after an untimed warm-up;
  ``rollout_scaling_2x`` = rollouts per second with 2 replicas / with 1. Long prompts make each replica's
  work compute-bound: CPU decoding at small batch is bound by memory bandwidth, which two replicas on one
  machine share, so short-prompt rollouts do not scale here (measured: 1.01x at 32 tokens, 6-word prompts).
- training: the same groups (gathered once, ``--train-words``-word prompts, 32 tokens) trained ``--steps`` times by a group of 1 rank, then of 2;
  timed around the trainer group's step (forward, backward, gradient sum, optimizer; no checkpoint
  writing, which rank 0 does alike in both); ``train_scaling_2x`` = seconds with 1 rank / with 2.

    python tests/benchmarks/ray_scaling.py [--rollouts 16] [--prompt-words 150] [--max-tokens 8] [--groups 6]

Goal: >= 1.5 each. On a real multi-GPU cluster each replica and rank has its own GPU (no shared cores, no
shared memory bandwidth), nccl replaces gloo for the gradient sum (NVLink/InfiniBand), and vLLM replicas
batch far more per step; there the ratios are bounded by the gateway's throughput (one process) and the
gradient all-reduce of the adapter, both small next to a GPU step. The last line is a JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROLLOUT = "ray_scaling:chat"
PROMPTS = ["Write a short poem about the sea.", "Explain photosynthesis to a child.",
           "List three uses of a paperclip.", "Describe your ideal weekend."]


async def chat(model: Any, task: dict[str, Any]) -> Any:
    """One rollout: a single chat call through the gateway, rebuilt from its record, with a random reward."""
    import openai

    rid = uuid.uuid4().hex
    client = openai.AsyncOpenAI(base_url=model.rollout_base_url(rid), api_key=model.api_key or "unused")
    prompt = task["prompt"] + " Context: " + " ".join(f"item{i}" for i in range(task["words"]))
    await client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=task["max_tokens"], temperature=1.0)
    await client.close()
    return model.rollout_trajectory(rid, reward=random.random())


def tree_cpu(root: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) so far of ``root`` and every process below it, by pid, with its role.

    Read from /proc (Linux). A local Ray cluster's raylet and GCS are children of the driver and its
    workers children of the raylet, so the tree is this run's cluster and nothing of anyone else's.
    """
    tick = os.sysconf("SC_CLK_TCK")
    procs: dict[int, tuple[int, float, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue  # ended meanwhile
        fields = stat[stat.rindex(")") + 2:].split()
        procs[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, title)
    out: dict[int, tuple[str, float]] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in procs:
            _, cpu, title = procs[pid]
            out[pid] = (_role(pid, root, title), cpu)
            todo += [child for child, (ppid, _, _) in procs.items() if ppid == pid]
    return out


def _role(pid: int, root: int, title: str) -> str:
    if pid == root:
        return "driver"  # the gateway, the router, the rollout pool: this process
    for name, role in (("EngineReplica", "replica"), ("TrainerRank", "rank"), ("RolloutWorker", "rollout_worker")):
        if f"ray::{name}" in title:
            return role
    return "ray_system"  # raylet, GCS, idle workers


def cpu_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, Any]:
    """CPU seconds each role used between two ``tree_cpu`` snapshots (replicas and ranks also one by one)."""
    roles: dict[str, float] = {}
    each: dict[str, list[float]] = {"replica": [], "rank": []}
    for pid, (role, cpu) in after.items():
        used = cpu - before.get(pid, (role, 0.0))[1]
        roles[role] = roles.get(role, 0.0) + used
        if role in each:
            each[role].append(round(used, 2))
    return {**{k: round(v, 2) for k, v in sorted(roles.items())},
            **{f"{k}_each": sorted(v, reverse=True) for k, v in each.items() if v}}


async def run_config(path: Path, replicas: int, ranks: int, args: argparse.Namespace,
                     groups: list[Any] | None) -> tuple[float, float, list[Any]]:
    from art_core import RayBackend, TrainableModel, TrainConfig

    model = TrainableModel(name=f"bench{replicas}{ranks}")
    root = HERE.parent.parent
    env = {"PYTHONPATH": os.pathsep.join([str(root / "core"), str(root), str(HERE)]), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    # A local cluster per configuration (started and stopped by the backend, files under `path`). Ray sees
    # this machine's cores; half a CPU each lets 2 replicas and 2 ranks be placed on 2 cores.
    backend = RayBackend(path=path / f"run{replicas}{ranks}", inference_replicas=replicas, trainer_workers=ranks,
                         rollout_workers=8, rollouts_per_worker=4, num_threads=1, cpus_per_replica=0.5,
                         cpus_per_rank=0.5, cpus_per_rollout_worker=0, runtime_env={"env_vars": env})
    async with backend:
        t0 = time.perf_counter()
        await model.register(backend)
        print(f"[{replicas} replica(s), {ranks} rank(s)] started in {time.perf_counter() - t0:.1f} s", flush=True)
        tasks = [{"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": args.max_tokens, "words": args.prompt_words}
                 for i in range(args.rollouts)]
        await backend.gather(model.spec, ROLLOUT, tasks[:8], n=1)  # warm-up: workers, replicas, caches
        routed = list(backend.router(model.spec).routed)
        cpu0, t0 = tree_cpu(os.getpid()), time.perf_counter()
        await backend.gather(model.spec, ROLLOUT, tasks, n=1)
        rollout_s = time.perf_counter() - t0
        rollout_cpu = cpu_by_role(cpu0, tree_cpu(os.getpid()))
        stats = backend.rollout_stats(model.spec, ROLLOUT)
        routed = [b - a for a, b in zip(routed, backend.router(model.spec).routed)]
        print(f"  rollouts: {args.rollouts} in {rollout_s:.2f} s ({args.rollouts / rollout_s:.2f}/s), "
              f"routed {routed}, failed {stats.failed_exception}; CPU s by role {rollout_cpu}; load "
              f"{os.getloadavg()[0]:.2f}", flush=True)
        if groups is None:
            short = [{**task, "words": args.train_words, "max_tokens": 32} for task in tasks[:args.groups]]
            groups = await backend.gather(model.spec, ROLLOUT, short, n=4)
        trainer = backend.trainer_group(model.spec)
        config = TrainConfig(learning_rate=1e-5)
        await trainer.train(groups[:2], config)  # warm-up step
        times = []
        cpu0 = tree_cpu(os.getpid())
        for _ in range(args.steps):
            t0 = time.perf_counter()
            result = await trainer.train(groups, config)
            times.append(time.perf_counter() - t0)
        train_cpu = cpu_by_role(cpu0, tree_cpu(os.getpid()))
        train_s = min(times)
        seconds = {k: round(v, 2) for k, v in result["metrics"].items() if k.startswith("seconds_")}
        print(f"  train step on {len(groups)} groups: {train_s:.2f} s (runs {[round(t, 2) for t in times]}; "
              f"slowest rank's {seconds}); CPU s by role over {args.steps} steps {train_cpu}; load "
              f"{os.getloadavg()[0]:.2f}", flush=True)
    return args.rollouts / rollout_s, train_s, groups, {"rollout_cpu_s": rollout_cpu, "train_cpu_s": train_cpu}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--prompt-words", type=int, default=150)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--train-words", type=int, default=40, help="prompt words of the rollouts trained on")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    with tempfile.TemporaryDirectory(prefix="art-ray-bench-") as tmp:
        load_start = os.getloadavg()[0]
        one_rate, one_train, groups, one_cpu = await run_config(Path(tmp), 1, 1, args, None)
        two_rate, two_train, _, two_cpu = await run_config(Path(tmp), 2, 2, args, groups)
    result = {"rollout_scaling_2x": round(two_rate / one_rate, 3), "train_scaling_2x": round(one_train / two_train, 3),
              "rollouts_per_s_1": round(one_rate, 3), "rollouts_per_s_2": round(two_rate, 3),
              "train_step_s_1": round(one_train, 3), "train_step_s_2": round(two_train, 3),
              "cpu_count": os.cpu_count(), "rollouts": args.rollouts, "prompt_words": args.prompt_words,
              "max_tokens": args.max_tokens,
              "groups": args.groups, "load_avg_start": round(load_start, 2),
              "load_avg_end": round(os.getloadavg()[0], 2), "cpu_s_1": one_cpu, "cpu_s_2": two_cpu}
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
