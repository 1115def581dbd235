"""The whole GRPO loop, sampling and training, ours (synchronous and pipelined) vs TRL's ``GRPOTrainer``.

The work: ``--steps`` GRPO steps (default 10) on a single-turn task, the README's adder: "What is a + b? Answer
with only the number.", ``--prompts-per-step`` questions per step (default 2), a group of ``--group-size``
completions per question (default 8), at most ``--max-tokens`` completion tokens each (default 16; the model
rambles), temperature 1, no top-p/top-k. The questions come in one seeded order, the same on every side, and each
question is asked once in the run. The reward gives partial credit (``reward``): 0 without the right sum in the
reply, else 0.5 + 0.5 x (share of the reply the sum takes), plus a tie-breaker under 0.01 drawn from a hash of
the reply, so a group rarely has all-equal rewards (see "deviations"). Every side trains the same base model (the
embedded SmolLM2-135M-Instruct) in fp32 on CPU with the same LoRA adapter (r=8, alpha=16, dropout 0, on q,k,v,o,gate,up,
down, initialised to the same values: ``_same_work.reset_adapter``), the same DAPO loss (token-level mean over the step,
clip 0.2/0.28, beta=0, group-std advantages), one optimizer step per step (AdamW, constant lr ``--lr``, default
1e-3 as in the README's adder; clipping at norm 1.0, no weight decay) on all of that step's groups.

``--bf16`` trains every side with bf16 matmuls, each its own way (sampling stays fp32 on both): ours with
``TrainConfig(base_matmul_dtype="bfloat16")`` (the frozen base weights' GEMMs on a bf16 copy; LoRA, norms,
attention, LM head and loss in fp32), TRL with ``bf16=True`` (accelerate's bf16 autocast over its training
forward: every linear layer, the LM head included). ``--packed-weights`` has our engine decode through oneDNN with
packed weights (``TransformersOptions(packed_weights=True)``: log-probs that differ from the default path's by
rounding); ``--packed-weights bfloat16`` packs them in bf16 (the sampling policy is then the bf16 model's, whose
log-probs the engine records); TRL's ``generate`` is unchanged. ``--prepacked-base-weights`` has our trainer run
the frozen base weights' products through oneDNN on fp32 copies packed once (``TrainConfig(prepacked_base_weights=
True)``: the same numbers to float rounding, two more copies of the linear weights in memory); TRL is unchanged.

The three sides, each in its own process:

* ``ours_sync``: the README's "Training loop": ``LocalBackend()`` as it defaults (the transformers engine decodes
  the trainer's own module; requests pause while a step trains), and per step ``model.sample(chat, n=G,
  max_tokens=M)`` for each of the step's questions (gathered, so the engine decodes them as one batch), the
  rewards, then ``model.train(groups, config=TrainConfig(loss="dapo", ...))``.
* ``ours_pipelined``: the README's "Asynchronous training": ``LocalBackend(pause_during_step=False,
  transformers=TransformersOptions(separate_module=True))`` (the engine decodes a copy of its own and keeps
  serving the last checkpoint while a step trains) and ``pipeline(model, tasks, play, steps=N,
  groups_per_step=P, max_off_policy=1, concurrency=2P)``, where ``play`` is the same ``model.sample`` + reward.
  It is given exactly the N x P questions, so it samples no group that is not trained.
* ``trl``: ``GRPOTrainer(...).train()`` with its own generation (transformers ``generate`` on the PEFT model, no
  vLLM) and the same reward as a reward function: ``per_device_train_batch_size = num_generations x P``,
  ``num_generations = G``, ``gradient_accumulation_steps = 1``, ``num_iterations = 1`` (one optimizer step per
  generated batch, so TRL runs no extra forward for old log-probs), ``max_steps = N``,
  ``max_completion_length = M``, ``shuffle_dataset=False`` (the dataset is already in the seeded order: step i
  asks the same P questions on every synchronous side).

What is timed: the whole loop, from after the model is loaded to the end of the last step. Ours: from after
``model.register(backend)`` (plus the adapter reset) to the return of the last ``model.train`` (sync) or of
``pipeline`` (pipelined): sampling, rewards, the steps, and what every step of ours does besides training (the
trajectories written to disk, the checkpoint and optimizer state written, the engine taking the new adapter:
the separate-module engine loads it from disk). TRL: ``trainer.train()``, the whole call (it builds its optimizer
and data loader, then per step generates, scores, computes advantages, trains and logs). Loading is reported
apart (ours: the trainer's model and, pipelined, the engine's copy; TRL: ``GRPOTrainer(...)``, its model load,
PEFT wrap and dataset preparation). ``steps/min`` = N / loop seconds. Per-step wall times are printed too
(ours: between the ends of consecutive steps; TRL: between its ``on_step_end`` callbacks), and the steps/min
after the first step (the first carries one-off costs, and the pipelined loop's first also samples the second
step's groups). Each step is split into sampling and training (ours_sync: the gathered ``model.sample`` calls,
then ``model.train``; ours_pipelined: the seconds a rollout ran and the seconds the step trained, which overlap;
TRL: its ``generate`` call, then the rest of its step: scoring, advantages, forward, backward, optimizer, logs).

Checks that the sides did the same work, printed: the prompt token ids the sides sampled from (ours from each
trajectory's record, TRL's from what it passed to ``generate``) must have one fingerprint (the same questions,
rendered by the same chat template), and the adapter's parameter names and shapes one fingerprint; the number of
optimizer steps each side took; the reward per step of each side (a sanity check that each loop samples, scores
and trains; the sides sample different completions, so rewards differ by chance); the completion tokens each
side generated.

Sampling is seeded (``--seed``: the questions' order and torch's seed, TRL's ``seed``), so every run of a side
samples the same completions: the rounds repeat the same work and differ only in time. The sides draw their
samples differently, so their completions, and as the adapters learn their lengths, drift apart by chance, and
shorter replies decode and train faster. With the default seed, on the development machine, ours' replies ended
up shorter (ours_sync 2005, ours_pipelined 2095 completion tokens against TRL's 2460 over the 10 steps); with seeds
1 and 2 they were about even (2396 and 2438 for ours_sync, 2185 and 2190 for ours_pipelined, against TRL's 2447
and 2336). So the completion tokens per loop second are printed too, as a check on the headline.

Deviations from "the same work", and from TRL's defaults:

* TRL's ``gradient_checkpointing=False`` (GRPOConfig's default True would recompute the forward), ``bf16=False``
  (fp32, as ours on CPU), ``lr_scheduler_type="constant"`` (ours has no GRPO schedule), ``beta=0`` (ours' default;
  no reference model on either side), ``epsilon_high=0.28`` (DAPO's clip-higher, ours' default), ``logging_steps=1``
  (for the per-step reward; its cost is in TRL's time), ``save_strategy="no"`` (TRL saves nothing during the loop;
  ours writes a checkpoint every step, inside its timed loop, as ``model.train`` always does).
* Ours sets ``tis_cap=None``: TRL without vLLM has no sampler/trainer importance correction, so the loss is TRL's
  DAPO exactly on-policy. (Off-policy samples in the pipelined loop still have their ratio taken against the
  sampler's recorded log-probs; that is not TIS.)
* A group whose rewards are all equal: ours drops it before its forward pass (``groups_dropped``; a step whose
  groups were all dropped takes no optimizer step and writes no checkpoint), TRL trains on it (zero advantages, a
  gradient of zero, still a forward and backward). The tie-breaker makes this rare; the count is printed per side
  (TRL's ``frac_reward_zero_std``).
* The pipelined loop trains some groups one step stale (``max_off_policy=1``): sampled by the checkpoint before
  the one it trains, corrected by the exact importance ratio; the synchronous sides are on-policy. Its steps
  take the groups as they finish (stalest first), so a step's questions may differ from the synchronous sides'
  step of the same index; the run's questions are the same.
* Our engine decodes a group's shared prompt once (prefix cache) and our trainer runs it once (``share_prefix``);
  TRL repeats each prompt G times in ``generate`` and in its forward. That is the same work done two ways, which
  is what is measured.

Timing on a shared 2-core machine: while any other process runs, 2-thread torch slows down by 2-10x, so a run is
only as good as the machine was quiet during it. Each run records how much CPU the *other* processes used during
its loop (from /proc/stat). Sides run interleaved, round by round (ours_sync, ours_pipelined, trl, then reversed),
each run in its own process, with the same torch threads (``--threads``, default 2, and ``OMP_NUM_THREADS``).
Per side the loop time used is the median over its quiet runs (others < 0.1 core during the loop) if it had any,
else its fastest run (other processes only ever add time); the JSON's ``timing_basis`` says which per side. In the
pipelined side, decoding and training run at once on two threads of the library's; the thread counts are left at
their defaults (the library's behaviour as shipped: while a step trains, the backend gives the trainer half of the
``--threads`` torch threads, the odd one, and the engine the rest; between steps the engine has them all).

Memory: peak RSS of each side's whole process (``ru_maxrss``: loading and the whole loop).

Run (about 9 minutes on 2 quiet cores with the defaults):
    cd /work/main && PYTHONPATH=core python tests/benchmarks/loop_vs_trl.py [--steps 10 --rounds 3]

The last line printed is one JSON object with ``loop_speedup_vs_trl`` (steps per minute, ours pipelined over
TRL's) and ``loop_speedup_sync_vs_trl`` (ours synchronous over TRL's).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import resource
import statistics
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

from _same_work import (  # noqa: E402 (beside this script)
    busy_cpu_seconds,
    reset_adapter,
    resolve_model,
    run_side_process,
)

SEED = 0
GOAL = 3.0  # ours pipelined at least this many times TRL's steps per minute (issue 25)
SIDES = ("ours_sync", "ours_pipelined", "trl")
QUIET_OTHERS_CORES = 0.1  # a run is "quiet" when other processes used less CPU than this during its loop

# The settings every side shares; ours' are its defaults (config.py), written out here for TRL.
LORA_RANK, LORA_ALPHA, LORA_DROPOUT = 8, 16, 0.0
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_GRAD_NORM = 1.0
EPSILON_LOW, EPSILON_HIGH = 0.2, 0.28  # DAPO's clip-higher; ours' DAPOLoss defaults
MAX_OFF_POLICY = 1  # the pipelined side's staleness bound


# --------------------------------------------------------------------------------------------------
# The shared task
# --------------------------------------------------------------------------------------------------

def make_questions(count: int, seed: int = SEED) -> list[tuple[int, int]]:
    """``count`` distinct additions (a + b, a in 2..19, b in 11..39), in one seeded order; the base model gets
    some of them right, some not, so groups have reward variance."""
    pairs = [(a, b) for a in range(2, 20) for b in range(11, 40)]
    if count > len(pairs):
        raise ValueError(f"{count} questions asked for, only {len(pairs)} distinct ones: fewer steps or prompts")
    random.Random(seed).shuffle(pairs)
    return pairs[:count]


def chat(a: int, b: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"What is {a} + {b}? Answer with only the number."}]


def reward(answer: str, a: int, b: int) -> float:
    """Partial credit (the README's): 0 without the sum, 0.5 + 0.5 x its share of the reply with it; plus a
    tie-breaker in [0, 0.01) from a hash of the reply, so that a group's rewards are rarely all equal.

    The tie-breaker has no direction: a length penalty, tried first, pulled the sides' completion lengths (hence
    their work) apart within ten steps, by chance (ours' replies got short first: 1715 completion tokens against
    TRL's 2225). It is the same on every side and in every process (crc32, not Python's salted ``hash``).
    """
    answer = answer.strip()
    target = str(a + b)
    tie_breaker = zlib.crc32(answer.encode()) % 1000 / 100_000
    if target not in answer:
        return tie_breaker
    return 0.5 + 0.5 * len(target) / len(answer) + tie_breaker


def _fingerprint(value: Any) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:12]


# --------------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------------

class Clock:
    """Wall time and the CPU other processes used (in cores) over a span, and over each step within it."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.start()

    @staticmethod
    def _now() -> tuple[float, float, float]:
        return time.perf_counter(), time.process_time(), busy_cpu_seconds()

    @staticmethod
    def _span(a: tuple[float, float, float], b: tuple[float, float, float]) -> dict[str, float]:
        seconds = b[0] - a[0]
        others = max(0.0, (b[2] - a[2]) - (b[1] - a[1]))
        return {"seconds": seconds, "others_cores": others / seconds if seconds > 0 else 0.0}

    def start(self) -> None:
        self._begin = self._mark = self._now()

    def tick(self) -> None:
        """A step ended: record the span since the previous one (or the start)."""
        now = self._now()
        self.steps.append(self._span(self._mark, now))
        self._mark = now

    def total(self) -> dict[str, float]:
        return self._span(self._begin, self._now())


# --------------------------------------------------------------------------------------------------
# Ours, in its own process
# --------------------------------------------------------------------------------------------------

async def _ours(model_dir: Path, questions: list[tuple[int, int]], scratch: str, *, pipelined: bool,
                steps: int, per_step: int, group_size: int, max_tokens: int, lr: float,
                bf16: bool, packed_weights: bool | str = False, prepacked_base: bool = False) -> dict[str, Any]:
    from art_core import LocalBackend, TrainableModel, TrainConfig, TrajectoryGroup, TransformersOptions, pipeline

    t0 = time.perf_counter()
    if pipelined:
        backend = LocalBackend(path=scratch, show_progress=False, pause_during_step=False,
                               transformers=TransformersOptions(separate_module=True, packed_weights=packed_weights))
    else:
        backend = LocalBackend(path=scratch, show_progress=False,
                               transformers=TransformersOptions(packed_weights=packed_weights))
    model = TrainableModel(name="adder", project="bench", base_model=str(model_dir))
    config = TrainConfig(loss="dapo", beta=0.0, learning_rate=lr, max_grad_norm=MAX_GRAD_NORM, weight_decay=0.0,
                         tis_cap=None, loss_options={"epsilon_low": EPSILON_LOW, "epsilon_high": EPSILON_HIGH},
                         base_matmul_dtype="bfloat16" if bf16 else None, prepacked_base_weights=prepacked_base)
    async with backend:
        await model.register(backend)
        adapter = reset_adapter(backend._models.get(model.spec).trainer.model, SEED)  # the trainer's module
        load_s = time.perf_counter() - t0

        prompts: list[list[int]] = []
        tokens = 0

        async def play(question: tuple[int, int]) -> TrajectoryGroup:
            nonlocal tokens
            a, b = question
            trajectories = await model.sample(chat(a, b), n=group_size, max_tokens=max_tokens)
            for t in trajectories:
                t.reward = reward(t.messages[-1].text(), a, b)
            prompts.append(list(trajectories[0].calls[0].prompt_token_ids))
            tokens += sum(len(c.completion_token_ids) for t in trajectories for c in t.calls)
            return TrajectoryGroup(trajectories)

        rows: list[dict[str, Any]] = []
        clock = Clock()
        if pipelined:
            before = [0]

            def log(line: str) -> None:  # after each step: its wall time since the previous one, and its tokens
                clock.tick()
                rows.append({"tokens": tokens - before[0]})
                before[0] = tokens

            report = await pipeline(model, iter(questions), play, steps=steps, groups_per_step=per_step,
                                    max_off_policy=MAX_OFF_POLICY, concurrency=per_step * (MAX_OFF_POLICY + 1),
                                    config=config, log=log)
            loop = clock.total()
            for row, s in zip(rows, report.steps):
                m = s.metrics
                row.update(reward=m["reward_mean"], trained=m.get("trained", 0.0),
                           dropped=m.get("groups_dropped", 0.0), stale_dropped=m.get("groups_stale", 0.0),
                           staleness_mean=m.get("staleness_mean", 0.0), overlap=s.overlap,
                           sample_s=s.seconds_rollout, train_s=s.seconds_train)  # these two overlap
            failed = report.rollouts_failed
        else:
            for i in range(steps):
                before, t0 = tokens, time.perf_counter()
                groups = await asyncio.gather(*(play(q) for q in questions[i * per_step:(i + 1) * per_step]))
                t1 = time.perf_counter()
                m = await model.train(list(groups), config=config)
                clock.tick()
                rows.append({"tokens": tokens - before, "reward": m["reward_mean"], "trained": m.get("trained", 0.0),
                             "dropped": m.get("groups_dropped", 0.0), "sample_s": t1 - t0,
                             "train_s": time.perf_counter() - t1})
            loop = clock.total()
            failed = 0
    for row, step in zip(rows, clock.steps):
        row.update(step)
    return {"adapter": adapter, "prompts": _fingerprint(sorted(prompts)), "load_s": load_s, "loop": loop,
            "steps": rows, "tokens": tokens, "optimizer_steps": sum(r["trained"] > 0 for r in rows),
            "rollouts_failed": failed}


# --------------------------------------------------------------------------------------------------
# TRL, in its own process
# --------------------------------------------------------------------------------------------------

def _trl(model_dir: Path, questions: list[tuple[int, int]], scratch: str, *, steps: int, per_step: int,
         group_size: int, max_tokens: int, lr: float, seed: int, bf16: bool) -> dict[str, Any]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    def adder_reward(completions: list[Any], a: list[int], b: list[int], **kwargs: Any) -> list[float]:
        return [reward(c[0]["content"], x, y) for c, x, y in zip(completions, a, b)]

    t0 = time.perf_counter()
    args = GRPOConfig(
        output_dir=scratch, report_to="none", logging_strategy="steps", logging_steps=1, save_strategy="no",
        disable_tqdm=True, use_cpu=True, bf16=bf16, fp16=False, model_init_kwargs={"dtype": "float32"},
        gradient_checkpointing=False,  # ours does not checkpoint; TRL's default (True) would recompute
        per_device_train_batch_size=group_size * per_step, num_generations=group_size,
        gradient_accumulation_steps=1, num_iterations=1, max_steps=steps, shuffle_dataset=False,
        max_completion_length=max_tokens, temperature=1.0, top_p=1.0, top_k=0,
        loss_type="dapo", scale_rewards="group", beta=0.0, epsilon=EPSILON_LOW, epsilon_high=EPSILON_HIGH,
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=MAX_GRAD_NORM, seed=seed, dataloader_num_workers=0,
    )
    dataset = Dataset.from_dict({"prompt": [chat(a, b) for a, b in questions],
                                 "a": [a for a, _ in questions], "b": [b for _, b in questions]})
    prompts: list[list[int]] = []
    tokens = [0]
    generate_s: list[float] = []  # one generate call per step (steps_per_generation = 1)
    clock = Clock()

    class Recorded(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids: Any, *a: Any, **k: Any) -> Any:
            # Each prompt comes num_generations times in a row (TRL's RepeatSampler): record it once.
            prompts.extend(list(p) for p in prompt_ids[::group_size])
            t0 = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *a, **k)
            generate_s.append(time.perf_counter() - t0)
            tokens[0] += sum(len(c) for c in completion_ids)
            return completion_ids, logprobs

    class Steps(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            clock.start()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            clock.tick()

    trainer = Recorded(
        model=str(model_dir), reward_funcs=adder_reward, args=args, train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Steps()],
        peft_config=LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=LORA_DROPOUT,
                               target_modules=LORA_TARGETS, task_type="CAUSAL_LM"),
    )
    adapter = reset_adapter(trainer.model, SEED)
    load_s = time.perf_counter() - t0
    outer = Clock()
    trainer.train()
    loop = outer.total()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    rows = []
    for i, step in enumerate(clock.steps):
        h = logs[i] if i < len(logs) else {}
        n = group_size * per_step
        rows.append({**step, "reward": h.get("reward", math.nan),
                     "tokens": h.get("completions/mean_length", math.nan) * n,
                     "dropped": h.get("frac_reward_zero_std", math.nan) * per_step, "trained": 1.0,
                     "sample_s": generate_s[i], "train_s": step["seconds"] - generate_s[i]})
    return {"adapter": adapter, "prompts": _fingerprint(sorted(prompts)), "load_s": load_s, "loop": loop,
            "steps": rows, "tokens": tokens[0], "optimizer_steps": trainer.state.global_step,
            "rollouts_failed": 0, "optimizer": f"{type(trainer.optimizer).__name__} ({args.optim})"}


def run_side(side: str, model_dir: Path, *, steps: int, per_step: int, group_size: int, max_tokens: int,
             lr: float, threads: int, seed: int, bf16: bool = False, packed_weights: bool | str = False,
             prepacked_base: bool = False) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(seed)  # sampling; TRL seeds its trainer with the same
    questions = make_questions(steps * per_step, seed)
    kwargs = {"steps": steps, "per_step": per_step, "group_size": group_size, "max_tokens": max_tokens, "lr": lr,
              "bf16": bf16}
    with tempfile.TemporaryDirectory(prefix="loop-bench-") as scratch:
        if side == "trl":
            result = _trl(model_dir, questions, scratch, seed=seed, **kwargs)
        else:
            result = asyncio.run(_ours(model_dir, questions, scratch, pipelined=side == "ours_pipelined",
                                       packed_weights=packed_weights, prepacked_base=prepacked_base, **kwargs))
    return {"side": side, "questions": _fingerprint(questions), **result,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB on Linux


# --------------------------------------------------------------------------------------------------
# The driver: interleaved subprocesses, then the report
# --------------------------------------------------------------------------------------------------

def _spawn(side: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    options = ["--model", str(model_dir), "--steps", str(args.steps), "--prompts-per-step", str(args.prompts_per_step),
               "--group-size", str(args.group_size), "--max-tokens", str(args.max_tokens), "--lr", repr(args.lr),
               "--threads", str(args.threads), "--seed", str(args.seed)] + (["--bf16"] if args.bf16 else []) \
        + (["--packed-weights", args.packed_weights] if args.packed_weights else []) \
        + (["--prepacked-base-weights"] if args.prepacked_base_weights else [])
    return run_side_process(__file__, side, options, threads=args.threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a local Hugging Face model folder, or a name art_core.models knows "
                             "(default: the embedded smollm2-135m-instruct)")
    parser.add_argument("--steps", type=int, default=10, help="GRPO steps per run (default 10)")
    parser.add_argument("--prompts-per-step", type=int, default=2, help="questions (groups) per step (default 2)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per question (default 8)")
    parser.add_argument("--max-tokens", type=int, default=16, help="most completion tokens (default 16)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate, constant (default 1e-3)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs of each side (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process (default 2)")
    parser.add_argument("--seed", type=int, default=SEED,
                        help=f"the questions' order and the sampling seed, the same on every side (default {SEED})")
    parser.add_argument("--bf16", action="store_true",
                        help="train with bf16 matmuls on every side: ours TrainConfig(base_matmul_dtype='bfloat16'), "
                             "TRL GRPOConfig(bf16=True) (autocast); sampling stays fp32 on both")
    parser.add_argument("--packed-weights", nargs="?", const="float32", default=False, choices=["float32", "bfloat16"],
                        help="our engine decodes through oneDNN with packed weights (TransformersOptions("
                             "packed_weights=...): float32 if no value is given, or bfloat16, whose sampling policy "
                             "differs from the float32 trainer's by bf16 rounding); TRL's generate is unchanged")
    parser.add_argument("--prepacked-base-weights", action="store_true",
                        help="ours trains with TrainConfig(prepacked_base_weights=True) (the frozen base's products "
                             "through oneDNN on pre-packed fp32 copies); TRL has no such option and is unchanged")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # internal: run one side
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.side:
        result = run_side(args.side, Path(args.model), steps=args.steps, per_step=args.prompts_per_step,
                          group_size=args.group_size, max_tokens=args.max_tokens, lr=args.lr, threads=args.threads,
                          seed=args.seed, bf16=args.bf16, packed_weights=args.packed_weights,
                          prepacked_base=args.prepacked_base_weights)
        Path(args.result_file).write_text(json.dumps(result))
        return

    model_dir = resolve_model(args.model)
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for round_index in range(args.rounds):
        for side in SIDES if round_index % 2 == 0 else SIDES[::-1]:  # ABC CBA: a drifting load hits no side more
            result = _spawn(side, model_dir, args)
            runs[side].append(result)
            loop = result["loop"]
            print(f"round {round_index + 1} {side:<15} load {result['load_s']:5.1f} s, loop {loop['seconds']:6.1f} s "
                  f"({60 * args.steps / loop['seconds']:5.2f} steps/min; others busy {loop['others_cores']:.2f} "
                  "cores), "
                  f"{result['tokens']} completion tokens, rewards "
                  f"[{', '.join(format(r['reward'], '.2f') for r in result['steps'])}]", flush=True)

    for key in ("questions", "prompts", "adapter"):
        seen = {r[key] for rs in runs.values() for r in rs}
        if len(seen) != 1:
            raise RuntimeError(f"the sides did not work on the same {key}: fingerprints {sorted(seen)}")
    report(runs, args)


def _loop_estimate(side_runs: list[dict[str, Any]]) -> tuple[float, str]:
    """A side's loop seconds: the median over its quiet runs, else its fastest run; and which it was."""
    quiet = [r["loop"]["seconds"] for r in side_runs if r["loop"]["others_cores"] < QUIET_OTHERS_CORES]
    if quiet:
        return statistics.median(quiet), f"quiet_runs ({len(quiet)}/{len(side_runs)})"
    return min(r["loop"]["seconds"] for r in side_runs), f"fastest_run (0/{len(side_runs)} quiet)"


def _after_first(run: dict[str, Any]) -> float:
    """Steps per minute over the steps after the first."""
    later = run["steps"][1:]
    return 60 * len(later) / sum(s["seconds"] for s in later) if later else math.nan


def report(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    """Print the table, the checks, and (last) the JSON line."""
    steps = args.steps
    estimate = {side: _loop_estimate(runs[side]) for side in SIDES}
    loop_s = {side: estimate[side][0] for side in SIDES}
    spm = {side: 60 * steps / loop_s[side] for side in SIDES}
    spm_all = {side: statistics.median(60 * steps / r["loop"]["seconds"] for r in runs[side]) for side in SIDES}
    spm_later = {side: statistics.median(_after_first(r) for r in runs[side]) for side in SIDES}
    load = {side: statistics.median(r["load_s"] for r in runs[side]) for side in SIDES}
    peak = {side: max(r["peak_rss_mib"] for r in runs[side]) for side in SIDES}
    tokens = {side: statistics.median(r["tokens"] for r in runs[side]) for side in SIDES}
    optimizer_steps = {side: [r["optimizer_steps"] for r in runs[side]] for side in SIDES}
    dropped = {side: [sum(s["dropped"] for s in r["steps"]) for r in runs[side]] for side in SIDES}
    speedup = spm["ours_pipelined"] / spm["trl"]
    speedup_sync = spm["ours_sync"] / spm["trl"]
    # Completion tokens per loop second: a check on the headline when the sides' replies differ in length.
    tps = {side: tokens[side] / loop_s[side] for side in SIDES}
    phase = {side: {key: statistics.median(s[key] for r in runs[side] for s in r["steps"])
                    for key in ("sample_s", "train_s")} for side in SIDES}

    print(f"\nGRPO loop: {steps} steps x {args.prompts_per_step} questions x {args.group_size} completions of at most "
          f"{args.max_tokens} tokens; model {args.model}; {'bf16 matmuls in training, ' if args.bf16 else ''}fp32 "
          f"CPU, {args.threads} threads; {args.rounds} run(s) "
          f"per side")
    header = (f"{'side':<16}{'loop s':>8}{'steps/min':>11}{'all runs':>10}{'after 1st':>11}{'load s':>8}"
              f"{'tokens':>8}{'opt steps':>11}{'dropped':>9}{'peak RSS MiB':>14}  basis")
    print(header)
    print("-" * len(header))
    for side in SIDES:
        print(f"{side:<16}{loop_s[side]:>8.1f}{spm[side]:>11.2f}{spm_all[side]:>10.2f}{spm_later[side]:>11.2f}"
              f"{load[side]:>8.1f}{tokens[side]:>8.0f}{'/'.join(map(str, optimizer_steps[side])):>11}"
              f"{'/'.join(f'{d:.0f}' for d in dropped[side]):>9}{peak[side]:>14.0f}  {estimate[side][1]}")
    print(f"loop s: median over quiet runs (others < {QUIET_OTHERS_CORES} core during the loop), else the fastest run; "
          "steps/min from it;\nall runs: median steps/min over every run; after 1st: median steps/min over steps 2.."
          "N; tokens: completion tokens generated\n(median over runs); opt steps, dropped: per run, optimizer steps "
          "taken and groups with all-equal rewards")
    print(f"\nloop speedup vs TRL, pipelined: {speedup:.2f}x (goal {GOAL}x: "
          f"{'met' if speedup >= GOAL else 'NOT met'}); synchronous: {speedup_sync:.2f}x; pipelined over "
          f"synchronous: {spm['ours_pipelined'] / spm['ours_sync']:.2f}x")
    print(f"all runs' medians: pipelined {spm_all['ours_pipelined'] / spm_all['trl']:.2f}x, synchronous "
          f"{spm_all['ours_sync'] / spm_all['trl']:.2f}x; after the first step: pipelined "
          f"{spm_later['ours_pipelined'] / spm_later['trl']:.2f}x, synchronous "
          f"{spm_later['ours_sync'] / spm_later['trl']:.2f}x")
    print(f"completion tokens per loop second (the sides' replies differ in length): pipelined "
          f"{tps['ours_pipelined'] / tps['trl']:.2f}x TRL's, synchronous {tps['ours_sync'] / tps['trl']:.2f}x")
    print("per step, median over every step of every run: " + "; ".join(
        f"{side} sampling {phase[side]['sample_s']:.2f} s, training {phase[side]['train_s']:.2f} s" for side in SIDES)
        + "\n(ours_sync: the gathered model.sample calls, then model.train; ours_pipelined: seconds with a rollout "
        "running, and with the step training, which overlap; trl: its generate call, then the rest of its step)")
    print(f"TRL optimizer: {runs['trl'][0].get('optimizer')}; same questions, prompt token ids and adapter on every "
          f"side (fingerprints {runs['trl'][0]['prompts']}, {runs['trl'][0]['adapter']})")
    print("reward per step (first run of each side):")
    for side in SIDES:
        print(f"  {side:<16}" + " ".join(f"{s['reward']:.3f}" for s in runs[side][0]["steps"]))
    pipelined = runs["ours_pipelined"][0]["steps"]
    print("pipelined, first run: staleness mean per step " + " ".join(f"{s['staleness_mean']:.2f}" for s in pipelined)
          + "; overlap " + " ".join(f"{s['overlap']:.0%}" for s in pipelined))

    print(json.dumps({
        "loop_speedup_vs_trl": round(speedup, 3),
        "goal_met": speedup >= GOAL,
        "loop_speedup_sync_vs_trl": round(speedup_sync, 3),
        "loop_speedup_pipelined_vs_sync": round(spm["ours_pipelined"] / spm["ours_sync"], 3),
        "bf16_matmuls": args.bf16, "packed_weights": args.packed_weights,
        "prepacked_base_weights": args.prepacked_base_weights,
        "steps_per_min": {side: round(spm[side], 3) for side in SIDES},
        "loop_s": {side: round(loop_s[side], 2) for side in SIDES},
        "timing_basis": {side: estimate[side][1] for side in SIDES},
        "loop_speedup_vs_trl_all_runs_median": round(spm_all["ours_pipelined"] / spm_all["trl"], 3),
        "loop_speedup_sync_vs_trl_all_runs_median": round(spm_all["ours_sync"] / spm_all["trl"], 3),
        "loop_speedup_vs_trl_after_first_step": round(spm_later["ours_pipelined"] / spm_later["trl"], 3),
        "loop_speedup_sync_vs_trl_after_first_step": round(spm_later["ours_sync"] / spm_later["trl"], 3),
        "loop_speedup_vs_trl_per_completion_token": round(tps["ours_pipelined"] / tps["trl"], 3),
        "loop_speedup_sync_vs_trl_per_completion_token": round(tps["ours_sync"] / tps["trl"], 3),
        "phase_s": {side: {k: round(v, 3) for k, v in phase[side].items()} for side in SIDES},
        "load_s": {side: round(load[side], 2) for side in SIDES},
        "peak_rss_mib": {side: round(peak[side]) for side in SIDES},
        "completion_tokens": {side: [r["tokens"] for r in runs[side]] for side in SIDES},
        "optimizer_steps": optimizer_steps,
        "groups_all_equal_rewards": dropped,
        "runs": {side: [{"loop_s": round(r["loop"]["seconds"], 2), "others_cores": round(r["loop"]["others_cores"], 2),
                         "step_s": [round(s["seconds"], 2) for s in r["steps"]],
                         "reward": [round(s["reward"], 4) for s in r["steps"]]} for r in runs[side]]
                 for side in SIDES},
        "pipelined_staleness_mean": [[round(s["staleness_mean"], 2) for s in r["steps"]]
                                     for r in runs["ours_pipelined"]],
        "model": args.model,
        "steps": steps,
        "prompts_per_step": args.prompts_per_step,
        "group_size": args.group_size,
        "max_tokens": args.max_tokens,
        "learning_rate": args.lr,
        "torch_threads": args.threads,
        "seed": args.seed,
        "rounds": args.rounds,
    }))


if __name__ == "__main__":
    main()
