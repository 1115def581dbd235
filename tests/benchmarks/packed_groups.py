"""One GRPO step of the demo's shape with packed groups (``TrainConfig.pack_groups``) and without, side by side.

The work: ``--groups`` groups (default 4) of ``--group-size`` completions (default 8) of ``--completion-tokens``
tokens (default 12), each group behind one of the demo's questions ("What is a + b? Answer with only the
number.", 46 prompt tokens through SmolLM2's chat template, of which the first 27 every question shares). The
completions are seeded random token ids with distinct rewards (no group is dropped): a step's cost depends only
on the token counts, so no sampling is needed. Both sides train the embedded SmolLM2-135M in fp32 with the same
fresh LoRA adapter (a trainer each, loaded from the same weights), ``TrainConfig(learning_rate=1e-3)``:

- ``packed``: the default; the groups' questions run as one batch on the shared 27-token root, and all their
  completions in one micro-batch, each row behind its own question (``training/batching.py``: ``PackedGroups``);
- ``apart``: ``pack_groups=False``, the code before packing: each group's question, then its completions, alone.

Timed: ``GRPOTrainer.train_step`` (the whole call), in this process, ``--threads`` torch threads (default 1, as a
Ray trainer rank or the vLLM layout's trainer has); the sides alternate step by step, ``--steps`` timed steps each
after one warm-up. Checks that the sides did the same work, printed: the forward tokens of each step, equal; the
first step's loss, and the gradient norm, to float rounding.

    PYTHONPATH=core python tests/benchmarks/packed_groups.py [--steps 6] [--threads 1]

The last line is a JSON object: ``packing_speedup`` (median apart over median packed), each side's medians and
every step's seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from art_core import CallRecord, LoraSettings, TrainConfig, Trajectory, TrajectoryGroup
from art_core.demo import make_tasks
from art_core.models import resolve_base_model
from art_core.training.loading import load_policy
from art_core.training.trainer import GRPOTrainer


def make_groups(tokenizer: Any, args: argparse.Namespace, step: int) -> list[TrajectoryGroup]:
    """The step's groups: the demo's questions, seeded random completions with distinct rewards."""
    g = torch.Generator().manual_seed(step)
    groups = []
    for task in make_tasks(args.groups, seed=1000 + step):
        text = tokenizer.apply_chat_template(task.messages(), add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        trajectories = [
            Trajectory(calls=[CallRecord(prompt_token_ids=prompt, completion_token_ids=torch.randint(
                100, 40000, (args.completion_tokens,), generator=g).tolist())], reward=float(i))
            for i in range(args.group_size)]
        groups.append(TrajectoryGroup(trajectories))
    return groups


def alternate_steps(sides: dict[str, tuple[GRPOTrainer, TrainConfig]], tokenizer: Any, args: argparse.Namespace
                    ) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    """``args.steps`` timed steps on each side after one warm-up, the sides alternating (their order flipped every
    step); checks that they ran the same forward tokens. Returns each side's step seconds and its first step's
    loss, gradient norm, micro-batches and forward tokens."""
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    first: dict[str, dict[str, float]] = {}
    for step in range(args.steps + 1):  # step 0 warms up
        groups = make_groups(tokenizer, args, step)
        order = list(sides) if step % 2 == 0 else list(reversed(sides))
        tokens = {}
        for name in order:
            trainer, config = sides[name]
            started = time.perf_counter()
            metrics = trainer.train_step(groups, config)
            elapsed = time.perf_counter() - started
            tokens[name] = metrics["forward_tokens"]
            if step == 0:
                first[name] = {k: metrics[k] for k in ("loss", "grad_norm", "micro_batches", "forward_tokens")}
            else:
                seconds[name].append(elapsed)
        assert len(set(tokens.values())) == 1, f"the sides ran different tokens: {tokens}"
        if step:
            times = ", ".join(f"{name} {seconds[name][-1]:.2f} s" for name in sides)
            print(f"step {step}: {times} ({tokens[order[0]]:.0f} forward tokens)", flush=True)
    return seconds, first


def step_shape_parser(description: str) -> argparse.ArgumentParser:
    """The command line of a benchmark that times this step shape: steps, threads and the shape itself."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--completion-tokens", type=int, default=12)
    return parser


def trainers(configs: dict[str, TrainConfig]) -> tuple[dict[str, tuple[GRPOTrainer, TrainConfig]], Any]:
    """A trainer per side, each on the embedded SmolLM2-135M with the same fresh adapter; and the tokenizer."""
    base = resolve_base_model("smollm2-135m-instruct")
    sides = {}
    for name, config in configs.items():
        torch.manual_seed(0)  # the same fresh adapter on every side
        policy, tokenizer = load_policy(base, LoraSettings(), device="cpu")
        sides[name] = (GRPOTrainer(policy, tokenizer), config)
    return sides, tokenizer


def main() -> None:
    args = step_shape_parser(__doc__.split("\n\n")[0]).parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()

    sides, tokenizer = trainers({name: TrainConfig(learning_rate=1e-3, pack_groups=name == "packed")
                                 for name in ("packed", "apart")})
    seconds, first = alternate_steps(sides, tokenizer, args)
    print(f"first step: packed {first['packed']}, apart {first['apart']}")
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    speedup = medians["apart"] / medians["packed"]
    print(f"median step: packed {medians['packed']:.2f} s, apart {medians['apart']:.2f} s: {speedup:.2f}x")
    print(json.dumps({"packing_speedup": round(speedup, 3), "median_seconds": medians, "seconds": seconds,
                      "first_step": first, "load_before": load_before, "load_after": os.getloadavg(),
                      "settings": vars(args)}))


if __name__ == "__main__":
    main()
