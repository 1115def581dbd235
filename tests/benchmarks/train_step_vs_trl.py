"""One GRPO training step, ours vs TRL's ``GRPOTrainer``, on the same work.

The work is the shape an agent with tools produces: one group of 8 completions of 64 tokens each, all
behind the same 256-token prompt (system prompt + tool schemas + task). Both sides train the same base
model in fp32 on CPU with the same LoRA adapter (r=8, alpha=16, dropout 0, on q,k,v,o,gate,up,down,
initialised to the same values: ``_same_work.reset_adapter``), the same DAPO loss (token-level mean, clip
0.2/0.28, beta=0), the same advantages, AdamW at lr 5e-5 and gradient clipping at norm 1.0, one
optimizer step per group.

What is timed (one "step"):

* ours: ``GRPOTrainer.train_step([group], TrainConfig(loss="dapo"))``, the whole call. It starts from
  ``Trajectory`` records holding token ids, so it includes turning records into samples and
  micro-batches, computing the advantages, then the forward + backward (the shared prompt is run once
  and its KV cache reused by the 8 suffixes: ``training/forward.py``), the per-token entropy it logs,
  gradient clipping, ``AdamW.step`` and ``zero_grad``.
* TRL: exactly what ``Trainer``'s loop runs for one optimizer step once ``_prepare_inputs`` has
  returned: ``trainer.compute_loss(model, inputs)`` (TRL's forward over the 8 full 320-token
  sequences through its fused LM head, log-probs and entropy, the DAPO loss and its metrics),
  ``accelerator.backward(loss)``, ``accelerator.clip_grad_norm_``, ``optimizer.step()`` (TRL's default
  optimizer, fused AdamW) and ``model.zero_grad()``. The ``inputs`` dict is the one
  ``_generate_and_score_completions`` would return, built here from the same token ids and our
  advantages: prompt_ids/prompt_mask [8, 256], completion_ids/completion_mask [8, 64], advantages [8],
  num_items_in_batch = 512. Generation and reward scoring happen before that point on both sides and
  are not timed on either.

Why this is the same work: the same tokens get the same log-probabilities under the same weights, and
the same loss and gradient follow; the first step's loss, gradient norm and entropy are printed for
both sides to check it. With one optimizer step per generated batch (``num_iterations=1``,
``gradient_accumulation_steps == steps_per_generation == 1``) and no vLLM, TRL's normal path sets
``old_per_token_logps=None`` (it uses the detached current log-probs, as we do), so TRL does *not* run
an extra no-grad forward pass here; the script reads that condition off the trainer and reports it.
On-policy the ratio is exactly 1, so the DAPO loss is -mean(advantage) over tokens, which is ~0 for
group-normalised advantages of equal-length completions: the gradient norm is the telling check.

Deviations from TRL's defaults, for the sake of same work: ``gradient_checkpointing=False`` (TRL's
GRPOConfig defaults to True, which would add a recomputed forward to TRL's time and lower its memory),
``bf16=False`` (fp32, as ours on CPU), constant learning rate (no scheduler step in the timing).

``--bf16`` adds two sides with bf16 matmuls, each side's own way: ``ours_bf16`` is ours with
``TrainConfig(base_matmul_dtype="bfloat16")`` (the frozen base weights' GEMMs on a bf16 copy; LoRA, norms,
attention, LM head and loss in fp32), ``trl_bf16`` is TRL with ``bf16=True`` (accelerate's bf16 autocast over the
forward: every linear layer, the LM head included, in bf16, the weights cast at each forward). The JSON then has
``bf16_speedup_ours``/``_trl`` (each side's fp32 step over its bf16 step) and ``speedup_vs_trl_bf16``.

Each side runs in its own subprocess (so peak memory is per side), interleaved round by round:
ours, TRL, ours without prefix sharing (the ablation that shows where the speed comes from), in
reverse order every other round. Each run does 1 warm-up step and N timed steps.

Timing on a shared 2-core machine: while any other process runs, 2-thread torch slows down by 2-10x
(each op waits for both threads), so a step is only as good as the machine was quiet during it. Each
step records how much CPU the *other* processes used meanwhile (from /proc/stat); the reported time
is the median over the quiet steps (others < 0.1 core) when every side has at least 2 of them, else
the median over all steps (the JSON's ``timing_basis`` says which); up to ``--max-rounds`` rounds are
run, the extra ones only for the sides still short of quiet steps. The all-steps median and the
fastest step are printed too, and every step's time with its "others busy" figure is in the JSON.

Memory: peak RSS of the whole process (``ru_maxrss``, includes loading), and the growth of RSS during
the steps over the RSS after setup (the peak mark is reset after setup via /proc/self/clear_refs).

Run:
    cd /work/main && PYTHONPATH=core python tests/benchmarks/train_step_vs_trl.py [--steps 3 --rounds 2]

The last line printed is one JSON object with the figures (``speedup_vs_trl`` = TRL's time / ours).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPT_TOKENS = 256  # a tool-using agent's system prompt + tool schemas + task
COMPLETION_TOKENS = 64
GROUP_SIZE = 8
from _same_work import (  # noqa: E402 (beside this script)
    busy_cpu_seconds,
    reset_adapter,
    resolve_model,
    run_side_process,
)

SEED = 0
GOAL = 5.0  # ours should be at least this many times faster than TRL (issue 17)
MEMORY_GOAL = 0.3  # and peak RSS at most this fraction of TRL's (issue 17)
SIDES = ("ours", "trl", "ours_no_prefix_share")
BF16_SIDES = ("ours_bf16", "trl_bf16")  # with --bf16: both sides' matmuls in bf16, each its own way
QUIET_OTHERS_CORES = 0.1  # a step is "quiet" when other processes used less CPU than this during it
MIN_QUIET_STEPS = 2  # per side, to time on quiet steps only

# The settings both sides share; ours' are its defaults (config.py), written out here for TRL.
LORA_RANK, LORA_ALPHA, LORA_DROPOUT = 8, 16, 0.0
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LEARNING_RATE, MAX_GRAD_NORM = 5e-5, 1.0
EPSILON_LOW, EPSILON_HIGH = 0.2, 0.28  # DAPO's clip-higher; ours' DAPOLoss defaults


# --------------------------------------------------------------------------------------------------
# The shared workload
# --------------------------------------------------------------------------------------------------

def make_workload(tokenizer: Any) -> dict[str, Any]:
    """One group: a shared prompt, 8 distinct completions, 8 distinct rewards, and their advantages.

    Token ids are drawn from the tokenizer's ordinary vocabulary (no special token, so no completion
    ends early on an end-of-turn id and every completion token is trained on both sides).
    """
    from art_core.training.advantages import compute_group_advantages
    from art_core.training.losses import DAPOLoss

    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(SEED)
    prompt = [rng.choice(vocab) for _ in range(PROMPT_TOKENS)]
    completions = [[rng.choice(vocab) for _ in range(COMPLETION_TOKENS)] for _ in range(GROUP_SIZE)]
    rewards = [i / (GROUP_SIZE - 1) for i in range(GROUP_SIZE)]  # all different: the group is not dropped
    rng.shuffle(rewards)
    # The advantages ours computes inside train_step (DAPO's default scale), handed to TRL as is.
    advantages = compute_group_advantages([rewards], scale=DAPOLoss.default_advantage_scale).advantages[0]
    assert advantages is not None
    fingerprint = hashlib.sha256(json.dumps([prompt, completions, advantages]).encode()).hexdigest()[:12]
    return {"prompt": prompt, "completions": completions, "rewards": rewards,
            "advantages": advantages, "fingerprint": fingerprint}


# --------------------------------------------------------------------------------------------------
# One side, in its own process
# --------------------------------------------------------------------------------------------------

def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) so the steps' own peak can be read afterwards."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_since_reset_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return math.nan


def _measured(step: Any) -> dict[str, float]:
    """Run one step; add its wall time, this process's CPU time, and how busy the rest of the machine was.

    ``others_cores`` is the CPU the other processes used during the step, in cores (1.0 = one core
    kept busy throughout): on 2 cores, even a little of it slows 2-thread torch a lot (the threads
    wait for each other at every op), so steps are later split into quiet and contended ones.
    """
    busy0, cpu0, t0 = busy_cpu_seconds(), time.process_time(), time.perf_counter()
    out = step()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    others = max(0.0, busy_cpu_seconds() - busy0 - cpu)
    return {"seconds": seconds, "cpu_seconds": cpu, "others_cores": others / seconds, **out}


def _ours_setup(model_dir: Path, work: dict[str, Any], *, share_prefix: bool,
                bf16: bool = False) -> tuple[Any, str, dict[str, Any]]:
    """Our trainer on the workload; returns (step function, adapter fingerprint, facts to report)."""
    from art_core.config import LoraSettings, TrainConfig
    from art_core.training.trainer import GRPOTrainer, load_policy
    from art_core.types import CallRecord, Trajectory, TrajectoryGroup

    model, tokenizer = load_policy(model_dir, LoraSettings(), device="cpu")
    adapter = reset_adapter(model, SEED)
    trainer = GRPOTrainer(model, tokenizer)
    group = TrajectoryGroup([
        Trajectory(calls=[CallRecord(prompt_token_ids=work["prompt"], completion_token_ids=c, logprobs=None)],
                   reward=r)
        for c, r in zip(work["completions"], work["rewards"])])
    config = TrainConfig(loss="dapo", beta=0.0, learning_rate=LEARNING_RATE, max_grad_norm=MAX_GRAD_NORM,
                         share_prefix=share_prefix, base_matmul_dtype="bfloat16" if bf16 else None)

    def step() -> dict[str, float]:
        m = trainer.train_step([group], config)
        return {"loss": m["loss"], "grad_norm": m["grad_norm"], "entropy": m["entropy"],
                "forward_tokens": m["forward_tokens"], "seconds_prepare": m["seconds_prepare"],
                "seconds_forward_backward": m["seconds_forward_backward"],
                "seconds_optimizer": m["seconds_optimizer"]}

    return step, adapter, {"optimizer": "torch.optim.AdamW", "extra_forward": False}


def _trl_setup(model_dir: Path, work: dict[str, Any], scratch: str, *,
               bf16: bool = False) -> tuple[Any, str, dict[str, Any]]:
    """TRL's GRPOTrainer with the inputs its compute_loss consumes; same return as ``_ours_setup``."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    def reward_never_called(completions: list[Any], **kwargs: Any) -> list[float]:
        # Needed to construct the trainer; scoring happens before the timed phase and is replaced by
        # the injected advantages.
        return [0.0] * len(completions)

    args = GRPOConfig(
        output_dir=scratch, report_to="none", logging_strategy="no", save_strategy="no",
        use_cpu=True, bf16=bf16, fp16=False, model_init_kwargs={"dtype": "float32"},  # bf16: autocast
        gradient_checkpointing=False,  # ours does not checkpoint; TRL's default (True) would recompute
        per_device_train_batch_size=GROUP_SIZE, num_generations=GROUP_SIZE, gradient_accumulation_steps=1,
        num_iterations=1, max_completion_length=COMPLETION_TOKENS, temperature=1.0,
        loss_type="dapo", beta=0.0, epsilon=EPSILON_LOW, epsilon_high=EPSILON_HIGH,
        learning_rate=LEARNING_RATE, lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=MAX_GRAD_NORM, seed=SEED,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(
        model=str(model_dir), reward_funcs=reward_never_called, args=args,
        train_dataset=Dataset.from_dict({"prompt": ["unused"] * GROUP_SIZE}), processing_class=tokenizer,
        peft_config=LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=LORA_DROPOUT,
                               target_modules=LORA_TARGETS, task_type="CAUSAL_LM"),
    )
    adapter = reset_adapter(trainer.model, SEED)
    trainer.create_optimizer()
    model, optimizer = trainer.accelerator.prepare(trainer.model, trainer.optimizer)  # as Trainer.train() does
    trainer.current_gradient_accumulation_steps = 1  # what Trainer.train() sets for a one-batch window
    # TRL's own condition (_generate_and_score_completions) for running an extra no-grad forward to get
    # old_per_token_logps; false here, so compute_loss uses the detached current log-probs, as ours does.
    generate_every = args.steps_per_generation * trainer.num_iterations
    extra_forward = bool(args.gradient_accumulation_steps % generate_every != 0
                         or (trainer.use_vllm and trainer.vllm_importance_sampling_correction))

    ones = torch.ones(GROUP_SIZE, PROMPT_TOKENS + COMPLETION_TOKENS, dtype=torch.long)
    inputs = {
        "prompt_ids": torch.tensor([work["prompt"]] * GROUP_SIZE),  # [G, P], left-padded (no padding here)
        "prompt_mask": ones[:, :PROMPT_TOKENS].clone(),  # [G, P]
        "completion_ids": torch.tensor(work["completions"]),  # [G, C]
        "completion_mask": ones[:, PROMPT_TOKENS:].clone(),  # [G, C]
        "advantages": torch.tensor(work["advantages"], dtype=torch.float32),  # [G]
        "num_items_in_batch": torch.tensor(GROUP_SIZE * COMPLETION_TOKENS),
    }

    def step() -> dict[str, float]:
        t0 = time.perf_counter()
        model.train()
        if extra_forward:  # not this configuration; would be part of TRL's post-generation work, so timed
            with torch.no_grad():
                ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)  # [G, P+C]
                mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)  # [G, P+C]
                inputs["old_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                    model, ids, mask, COMPLETION_TOKENS, batch_size=GROUP_SIZE)[0]  # [G, C]
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(model, inputs, num_items_in_batch=inputs["num_items_in_batch"])
        t1 = time.perf_counter()
        trainer.accelerator.backward(loss)
        t2 = time.perf_counter()
        grad_norm = trainer.accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        model.zero_grad()
        t3 = time.perf_counter()
        return {"loss": loss.item(), "grad_norm": float(grad_norm),
                "entropy": trainer._metrics["train"]["entropy"][-1],
                "forward_tokens": float(GROUP_SIZE * (PROMPT_TOKENS + COMPLETION_TOKENS)),
                "seconds_forward": t1 - t0, "seconds_backward": t2 - t1,
                "seconds_forward_backward": t2 - t0, "seconds_optimizer": t3 - t2}

    optimizer_name = f"{type(trainer.optimizer).__name__} ({args.optim})"
    return step, adapter, {"optimizer": optimizer_name, "extra_forward": extra_forward}


def run_side(side: str, model_dir: Path, *, steps: int, threads: int) -> dict[str, Any]:
    """Set up one side, run 1 warm-up step and ``steps`` timed steps, and measure memory."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(SEED)
    from transformers import AutoTokenizer

    work = make_workload(AutoTokenizer.from_pretrained(model_dir))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as scratch:
        if side.startswith("trl"):
            step, adapter, info = _trl_setup(model_dir, work, scratch, bf16=side == "trl_bf16")
        else:
            step, adapter, info = _ours_setup(model_dir, work, share_prefix=side != "ours_no_prefix_share",
                                              bf16=side == "ours_bf16")
        setup_s = time.perf_counter() - t0
        rss_setup = _rss_mib()
        peak_reset = _reset_peak_rss()
        first = _measured(step)  # warm-up; it is also the first optimizer step, compared across sides
        timed = [_measured(step) for _ in range(steps)]
    step_peak = _peak_rss_since_reset_mib() if peak_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "side": side, "workload": work["fingerprint"], "adapter": adapter, **info,
        "setup_s": setup_s, "first": first, "timed": timed,
        "rss_after_setup_mib": rss_setup,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
        "step_rss_growth_mib": step_peak - rss_setup,
        "step_peak_measured_exactly": peak_reset,
    }


# --------------------------------------------------------------------------------------------------
# The driver: interleaved subprocesses, then the report
# --------------------------------------------------------------------------------------------------

def _spawn(side: str, model_dir: Path, *, steps: int, threads: int) -> dict[str, Any]:
    options = ["--model", str(model_dir), "--steps", str(steps), "--threads", str(threads)]
    return run_side_process(__file__, side, options, threads=threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a local Hugging Face model folder, or a name art_core.models knows "
                             "(default: the embedded smollm2-135m-instruct)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run, after 1 warm-up (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of all sides (default 2)")
    parser.add_argument("--max-rounds", type=int, default=4,
                        help="run extra rounds, up to this many, for sides with fewer than "
                             f"{MIN_QUIET_STEPS} quiet steps (default 4)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process (default 2)")
    parser.add_argument("--bf16", action="store_true",
                        help="also run both sides with bf16 matmuls: ours with TrainConfig(base_matmul_dtype="
                             "'bfloat16'), TRL with GRPOConfig(bf16=True) (autocast)")
    parser.add_argument("--side", choices=SIDES + BF16_SIDES, help=argparse.SUPPRESS)  # internal: run one side
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.side:
        result = run_side(args.side, Path(args.model), steps=args.steps, threads=args.threads)
        Path(args.result_file).write_text(json.dumps(result))
        return

    model_dir = resolve_model(args.model)
    sides = SIDES + BF16_SIDES if args.bf16 else SIDES
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    round_index, max_rounds = 0, max(args.max_rounds, args.rounds)
    while round_index < max_rounds:
        # Reversed every other round (ABC CBA ...): a load that drifts over a round hits no side more.
        order = sides if round_index % 2 == 0 else sides[::-1]
        if round_index >= args.rounds:  # extra rounds: only for the sides still short of quiet steps
            order = tuple(side for side in order if _quiet_steps(runs[side]) < MIN_QUIET_STEPS)
            if not order:
                break
        for side in order:
            result = _spawn(side, model_dir, steps=args.steps, threads=args.threads)
            runs[side].append(result)
            times = ", ".join(f"{t['seconds']:.2f}" for t in result["timed"])
            others = ", ".join(f"{t['others_cores']:.2f}" for t in result["timed"])
            print(f"round {round_index + 1} {side:<22} setup {result['setup_s']:5.1f} s, "
                  f"warm-up {result['first']['seconds']:.2f} s, steps [{times}] s, others busy [{others}] cores",
                  flush=True)
        round_index += 1

    for key in ("workload", "adapter"):
        seen = {r[key] for rs in runs.values() for r in rs}
        if len(seen) != 1:
            raise RuntimeError(f"the sides did not train on the same {key}: fingerprints {sorted(seen)}")

    report(runs, model_name=args.model, model_dir=model_dir, threads=args.threads, rounds=round_index,
           steps=args.steps)


def _quiet_steps(runs: list[dict[str, Any]]) -> int:
    return sum(t["others_cores"] < QUIET_OTHERS_CORES for r in runs for t in r["timed"])


def report(runs: dict[str, list[dict[str, Any]]], *, model_name: str, model_dir: Path, threads: int,
           rounds: int, steps: int) -> None:
    """Print the table, the checks, and (last) the JSON line."""
    sides = tuple(runs)
    timed = {side: [t for r in rs for t in r["timed"]] for side, rs in runs.items()}  # every timed step
    quiet = {side: [t for t in ts if t["others_cores"] < QUIET_OTHERS_CORES] for side, ts in timed.items()}
    # Other processes only ever add time, and on 2 cores they add a lot: time on the quiet steps when
    # every side has enough of them, else on all steps (and say which).
    use_quiet = all(len(q) >= MIN_QUIET_STEPS for q in quiet.values())
    basis = quiet if use_quiet else timed

    def med(side: str, key: str, steps_by_side: dict[str, list[dict[str, Any]]] = basis) -> float:
        values = [t[key] for t in steps_by_side[side] if key in t]
        return statistics.median(values) if values else math.nan

    step_s = {side: med(side, "seconds") for side in sides}
    all_s = {side: med(side, "seconds", timed) for side in sides}
    best_s = {side: min(t["seconds"] for t in timed[side]) for side in sides}
    peak = {side: max(r["peak_rss_mib"] for r in runs[side]) for side in sides}
    growth = {side: max(r["step_rss_growth_mib"] for r in runs[side]) for side in sides}
    tokens = {side: runs[side][0]["first"]["forward_tokens"] for side in sides}
    first = {side: runs[side][0]["first"] for side in sides}
    speedup = step_s["trl"] / step_s["ours"]
    basis_name = f"quiet steps (others < {QUIET_OTHERS_CORES} core)" if use_quiet else "all steps (too few quiet)"

    print(f"\nGRPO training step: {GROUP_SIZE} completions x {COMPLETION_TOKENS} tokens behind a shared "
          f"{PROMPT_TOKENS}-token prompt; model {model_name} ({model_dir}); fp32 CPU, {threads} threads; "
          f"{rounds} rounds x (1 warm-up + {steps} steps); median over {basis_name}")
    header = (f"{'side':<22}{'step s':>8}{'all s':>8}{'best s':>8}{'quiet':>7}{'fwd+bwd s':>11}{'optim s':>9}"
              f"{'fwd tokens':>12}{'peak RSS MiB':>14}{'step +RSS MiB':>15}")
    print(header)
    print("-" * len(header))
    for side in sides:
        print(f"{side:<22}{step_s[side]:>8.2f}{all_s[side]:>8.2f}{best_s[side]:>8.2f}"
              f"{len(quiet[side]):>4}/{len(timed[side]):<2}{med(side, 'seconds_forward_backward'):>11.2f}"
              f"{med(side, 'seconds_optimizer'):>9.3f}{tokens[side]:>12.0f}{peak[side]:>14.0f}{growth[side]:>15.0f}")
    print("step s: median wall time on the basis above; all s: median over every timed step; best s: fastest "
          "step;\nquiet: steps during which other processes used under "
          f"{QUIET_OTHERS_CORES} core; peak RSS: whole process; step +RSS: peak during the steps over RSS after setup")
    print(f"\nspeedup vs TRL: {speedup:.2f}x (goal {GOAL}x: {'met' if speedup >= GOAL else 'NOT met'}); "
          f"all steps {all_s['trl'] / all_s['ours']:.2f}x, best steps {best_s['trl'] / best_s['ours']:.2f}x; "
          f"prefix sharing alone: {step_s['ours_no_prefix_share'] / step_s['ours']:.2f}x")
    memory_ratio = peak["ours"] / peak["trl"]
    print(f"peak RSS vs TRL: {memory_ratio:.3f}x (goal <= {MEMORY_GOAL}x: "
          f"{'met' if memory_ratio <= MEMORY_GOAL else 'NOT met'})")
    print(f"TRL extra no-grad forward for old_per_token_logps in its normal path: "
          f"{'yes (timed)' if runs['trl'][0]['extra_forward'] else 'no'}; TRL optimizer: "
          f"{runs['trl'][0]['optimizer']}")
    bf16: dict[str, Any] = {}
    if "ours_bf16" in runs:
        bf16 = {"ours_bf16_step_s": round(step_s["ours_bf16"], 4), "trl_bf16_step_s": round(step_s["trl_bf16"], 4),
                "bf16_speedup_ours": round(step_s["ours"] / step_s["ours_bf16"], 3),
                "bf16_speedup_trl": round(step_s["trl"] / step_s["trl_bf16"], 3),
                "speedup_vs_trl_bf16": round(step_s["trl_bf16"] / step_s["ours_bf16"], 3)}
        print(f"bf16 matmuls: ours {bf16['bf16_speedup_ours']:.2f}x faster than its fp32 step "
              f"(TrainConfig(base_matmul_dtype='bfloat16')), TRL {bf16['bf16_speedup_trl']:.2f}x (bf16=True: "
              f"autocast); ours vs TRL, both bf16: {bf16['speedup_vs_trl_bf16']:.2f}x")
    print("first step (same weights, same tokens):")
    for side in sides:
        f = first[side]
        print(f"  {side:<22} loss {f['loss']:+.3e}  grad_norm {f['grad_norm']:.6f}  entropy {f['entropy']:.6f}")
    loss_diff = abs(first["ours"]["loss"] - first["trl"]["loss"])
    grad_rel = abs(first["ours"]["grad_norm"] - first["trl"]["grad_norm"]) / first["trl"]["grad_norm"]
    agree = loss_diff < 1e-5 and grad_rel < 1e-3
    print(f"  ours vs TRL: loss diff {loss_diff:.1e}, grad-norm rel diff {grad_rel:.1e} -> "
          f"{'same computation' if agree else 'MISMATCH: the comparison is not of the same work'}")

    print(json.dumps({
        "speedup_vs_trl": round(speedup, 3),
        "goal_met": speedup >= GOAL,
        "peak_rss_ratio_vs_trl": round(memory_ratio, 3),
        "memory_goal_met": memory_ratio <= MEMORY_GOAL,
        "timing_basis": "quiet_steps" if use_quiet else "all_steps",
        "ours_step_s": round(step_s["ours"], 4),
        "trl_step_s": round(step_s["trl"], 4),
        "ours_no_prefix_share_step_s": round(step_s["ours_no_prefix_share"], 4),
        "speedup_vs_trl_all_steps": round(all_s["trl"] / all_s["ours"], 3),
        "speedup_vs_trl_best_step": round(best_s["trl"] / best_s["ours"], 3),
        "ours_breakdown_s": {k: round(med("ours", k), 4)
                             for k in ("seconds_prepare", "seconds_forward_backward", "seconds_optimizer")},
        "trl_breakdown_s": {k: round(med("trl", k), 4)
                            for k in ("seconds_forward", "seconds_backward", "seconds_optimizer")},
        "ours_peak_rss_mib": round(peak["ours"]),
        "trl_peak_rss_mib": round(peak["trl"]),
        "ours_no_prefix_share_peak_rss_mib": round(peak["ours_no_prefix_share"]),
        "ours_step_rss_growth_mib": round(growth["ours"]),
        "trl_step_rss_growth_mib": round(growth["trl"]),
        "ours_no_prefix_share_step_rss_growth_mib": round(growth["ours_no_prefix_share"]),
        "ours_forward_tokens": tokens["ours"],
        "trl_forward_tokens": tokens["trl"],
        "steps": {side: [[round(t["seconds"], 3), round(t["others_cores"], 2)] for t in timed[side]]
                  for side in sides},
        "first_step": {side: {k: first[side][k] for k in ("loss", "grad_norm", "entropy")} for side in sides},
        "first_step_agree": agree,
        "trl_extra_old_logps_forward": runs["trl"][0]["extra_forward"],
        "model": model_name,
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": COMPLETION_TOKENS,
        "group_size": GROUP_SIZE,
        "torch_threads": threads,
        "rounds": rounds,
        "timed_steps_per_round": steps,
        **bf16,
    }))

if __name__ == "__main__":
    main()
