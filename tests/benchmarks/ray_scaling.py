"""RayBackend scaling on this machine: rollout throughput with 1 vs 2 engine replicas, step time with 1 vs 2
trainer ranks, side by side in one run.

One local Ray cluster (temp files under the run's folder) holds 2 replicas, the backend's 2-rank trainer
group and a 1-rank group. Each replica and rank is held to one torch thread (``num_threads=1``) so that, on
a 2-core machine, each has a core of its own. The configurations are alternated round by round, so a change
of load on a shared machine hits both alike; each ratio compares the best round of each. Model: the
embedded SmolLM2-135M-Instruct on CPU (fp32).

- rollouts: ``--rollouts`` one-call chat rollouts (a prompt of about ``--prompt-words`` words,
  ``--max-tokens`` sampled tokens) on ``--rollout-workers`` workers through the one gateway, after an
  untimed warm-up, routed to replica 0 alone ("1 replica"; the other stays loaded and idle) or to both;
  ``rollout_scaling_2x`` = rollouts per second with 2 replicas / with 1. Long prompts give each request
  enough work that the replicas, not the gateway, the rollout workers or Ray, are the bottleneck, as on a
  real deployment: with 6-word prompts and 32 tokens, each request's fixed costs (an HTTP client per
  rollout, two Ray calls, the records fetch) and small-batch decoding, bound by memory bandwidth that
  two replicas on one machine share, kept the ratio at 1.01x.
- training: the same groups (``--train-words``-word prompts, 32 tokens) trained by the 1-rank group, then
  by the 2-rank group (split by tokens), ``--steps`` times each; timed around the trainer group's step
  (forward, backward, gradient sum, optimizer, rank 0's checkpoint files, which both groups write);
  ``train_scaling_2x`` = seconds with 1 rank / with 2.
- ``cpu_s``: CPU seconds of each role (driver = gateway + router + pool, replicas, ranks, rollout workers,
  Ray's own processes) in each timed phase, read from /proc: where the time goes, whatever the load.
  An idle Ray process costs about 1% of a core, so the defaults use 2 rollout workers of 8 rollouts each.

    python tests/benchmarks/ray_scaling.py [--rollouts 16] [--prompt-words 150] [--max-tokens 8] [--groups 8]

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
    prompt = (f"Request {task['nonce']}. " + task["prompt"] + " Context: "
              + " ".join(f"item{i}" for i in range(task["words"])))
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


class only_first_replica:
    """Route every request to replica 0 while inside (the other stays loaded and idle): "1 replica".

    Benchmark-only: it flips the router's private liveness flags and restores them on exit.
    """

    def __init__(self, router: Any) -> None:
        self.router = router

    def __enter__(self) -> None:
        self.saved = list(self.router._alive)
        self.router._alive[1:] = [False] * (len(self.saved) - 1)

    def __exit__(self, *exc: object) -> None:
        self.router._alive[:] = self.saved


async def measure(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Both configurations in one local cluster, alternated round by round (a load change on a shared
    machine then hits both alike): rollouts through replica 0 alone, then through both; steps of a 1-rank
    group, then of the 2-rank group, on the same groups."""
    from art_core import RayBackend, TrainableModel, TrainConfig
    from art_core.backends.ray.trainer_group import TrainerGroup

    model = TrainableModel(name="bench", **({"base_model": args.base_model} if args.base_model else {}))
    root = HERE.parent.parent
    env = {"PYTHONPATH": os.pathsep.join([str(root / "core"), str(root), str(HERE)]), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    # Started and stopped by the backend, files under `path`. Ray sees this machine's 2 cores; a quarter
    # CPU each lets 2 replicas and 3 ranks (the 2-rank group and the 1-rank one) be placed.
    backend = RayBackend(path=path / "run", inference_replicas=2, trainer_workers=2,
                         rollout_workers=args.rollout_workers, rollouts_per_worker=args.per_worker,
                         num_threads=1, cpus_per_replica=0.25, cpus_per_rank=0.25, cpus_per_rollout_worker=0,
                         runtime_env={"env_vars": env})
    out: dict[str, Any] = {"rollout_s": {1: [], 2: []}, "train_s": {1: [], 2: []}, "cpu": {}}
    async with backend:
        t0 = time.perf_counter()
        await model.register(backend)
        solo = await TrainerGroup.start(workers=1, base_dir=model.spec.base_model, lora=model.spec.lora,
                                        checkpoint=None, num_threads=1, gpus_per_rank=0, cpus_per_rank=0.25, sharding="none")
        print(f"[2 replicas, a 2-rank and a 1-rank group] started in {time.perf_counter() - t0:.1f} s", flush=True)
        router = backend.router(model.spec)
        # Each task's prompt starts with a fresh nonce, shared only by the rollouts of one group: the engines keep
        # the states of prompts they have seen, and repeating prompts across rounds would time little but HTTP
        # and Ray after the warm-up (a GRPO group's rollouts do share their prompt, as the training groups do).
        def fresh_tasks() -> list[dict[str, Any]]:
            return [{"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": args.max_tokens, "words": args.prompt_words,
                     "nonce": uuid.uuid4().hex[:8]} for i in range(args.rollouts)]

        await backend.gather(model.spec, ROLLOUT, fresh_tasks()[:8], n=1)  # warm-up: workers, replicas
        tasks = fresh_tasks()
        for r in range(args.rounds):
            for replicas in (1, 2):
                tasks = fresh_tasks()
                routed = list(router.routed)
                cpu0, t0 = tree_cpu(os.getpid()), time.perf_counter()
                if replicas == 1:
                    with only_first_replica(router):
                        await backend.gather(model.spec, ROLLOUT, tasks, n=1)
                else:
                    await backend.gather(model.spec, ROLLOUT, tasks, n=1)
                seconds = time.perf_counter() - t0
                cpu = cpu_by_role(cpu0, tree_cpu(os.getpid()))
                out["rollout_s"][replicas].append(seconds)
                out["cpu"][f"rollouts_{replicas}_round{r}"] = cpu
                failed = backend.rollout_stats(model.spec, ROLLOUT).failed_exception
                print(f"  round {r}, {replicas} replica(s): {args.rollouts} rollouts in {seconds:.2f} s, routed "
                      f"{[b - a for a, b in zip(routed, router.routed)]}, failed {failed}; CPU s {cpu}; load "
                      f"{os.getloadavg()[0]:.2f}", flush=True)
        short = [{**task, "words": args.train_words, "max_tokens": 32} for task in tasks[:args.groups]]
        groups = await backend.gather(model.spec, ROLLOUT, short, n=4)
        groups = [g for g in groups if len(set(g.rewards)) > 1]
        config = TrainConfig(learning_rate=1e-5)
        duo = backend.trainer_group(model.spec)
        for group in (solo, duo):
            await group.train(groups[:2], config)  # warm-up step
        for r in range(args.steps):
            for ranks, group in ((1, solo), (2, duo)):
                cpu0, t0 = tree_cpu(os.getpid()), time.perf_counter()
                result = await group.train(groups, config)
                seconds = time.perf_counter() - t0
                cpu = cpu_by_role(cpu0, tree_cpu(os.getpid()))
                out["train_s"][ranks].append(seconds)
                out["cpu"][f"train_{ranks}_round{r}"] = cpu
                inner = {k: round(v, 2) for k, v in result["metrics"].items() if k.startswith("seconds_")}
                print(f"  round {r}, {ranks} rank(s): a step on {len(groups)} groups in {seconds:.2f} s (shares "
                      f"{result['shares']}; slowest rank's {inner}); CPU s {cpu}; load {os.getloadavg()[0]:.2f}",
                      flush=True)
        await solo.aclose()
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--rollout-workers", type=int, default=2,
                        help="rollout worker actors (each a process: an idle Ray process costs ~1%% of a core)")
    parser.add_argument("--per-worker", type=int, default=8, help="rollouts each worker runs at once")
    parser.add_argument("--prompt-words", type=int, default=150)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--train-words", type=int, default=40, help="prompt words of the rollouts trained on")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2, help="timed steps of each group, alternated")
    parser.add_argument("--base-model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=2, help="timed rollout rounds of each configuration, alternated")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    with tempfile.TemporaryDirectory(prefix="art-ray-bench-") as tmp:
        load_start = os.getloadavg()[0]
        out = await measure(Path(tmp), args)
    roll, train = out["rollout_s"], out["train_s"]
    one_rate, two_rate = args.rollouts / min(roll[1]), args.rollouts / min(roll[2])
    result = {"rollout_scaling_2x": round(two_rate / one_rate, 3),
              "train_scaling_2x": round(min(train[1]) / min(train[2]), 3),
              "rollout_scaling_2x_per_round": [round(a / b, 3) for a, b in zip(roll[1], roll[2])],
              "train_scaling_2x_per_round": [round(a / b, 3) for a, b in zip(train[1], train[2])],
              "rollouts_per_s_1": round(one_rate, 3), "rollouts_per_s_2": round(two_rate, 3),
              "train_step_s_1": round(min(train[1]), 3), "train_step_s_2": round(min(train[2]), 3),
              "cpu_count": os.cpu_count(), "rollouts": args.rollouts, "prompt_words": args.prompt_words,
              "max_tokens": args.max_tokens, "rollout_workers": args.rollout_workers, "per_worker": args.per_worker,
              "groups": args.groups, "load_avg_start": round(load_start, 2),
              "load_avg_end": round(os.getloadavg()[0], 2), "cpu_s": out["cpu"]}
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
