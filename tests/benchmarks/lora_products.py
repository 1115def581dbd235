"""One GRPO step of the demo's shape with the fused LoRA layers' rank-r products in the layout they use
(``training/fused_lora.py``: ``_rank_product``, ``_factor_gradient``) and in the plain one, side by side.

The fused LoRA layer's small products, ``x @ A.T`` and ``grad @ B`` (``[N, r]`` results) and ``grad.T @ down`` (LoRA
B's gradient, ``[out, r]``), are computed as the transposed problems (a few rows of many columns), which MKL runs
much faster than a few columns of many rows. ``plain`` computes them as written, the way the layer did before;
``rank_products`` as the library does. The two sides are the same trainer code on the same step (``packed_groups.py``'s
shape: ``--groups`` groups of ``--group-size`` completions of ``--completion-tokens`` seeded tokens behind the demo's
questions), each with its own trainer loaded from the same weights, alternating step by step, ``--threads`` torch
threads (default 1, as a Ray trainer rank or a pipelined ``LocalBackend`` step has). The plain side swaps the two
functions for their plain forms for the duration of its own steps only.

    PYTHONPATH=core python tests/benchmarks/lora_products.py [--steps 6] [--threads 1]

Printed: each step's seconds per side, the first step's loss and gradient norm per side (equal to rounding). The last
line is a JSON object: ``lora_products_speedup`` (median plain over median rank_products), the medians, every step.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from packed_groups import alternate_steps, step_shape_parser, trainers  # this folder's: the same step

from art_core import TrainConfig
from art_core.training import fused_lora
from art_core.training.trainer import GRPOTrainer


@contextlib.contextmanager
def _plain_products() -> Iterator[None]:
    """Within the block, the fused layers take their rank-r products as written (restored after)."""
    rank_product, factor_gradient = fused_lora._rank_product, fused_lora._factor_gradient
    fused_lora._rank_product = lambda rows, factor: rows @ factor.t()
    fused_lora._factor_gradient = lambda grad_rows, down: grad_rows.t() @ down
    try:
        yield
    finally:
        fused_lora._rank_product, fused_lora._factor_gradient = rank_product, factor_gradient


class _PlainSide:
    """A trainer whose steps run inside ``_plain_products``."""

    def __init__(self, trainer: GRPOTrainer) -> None:
        self.trainer = trainer

    def train_step(self, groups: Sequence[Any], config: TrainConfig) -> Any:
        with _plain_products():
            return self.trainer.train_step(groups, config)


def main() -> None:
    args = step_shape_parser(__doc__.split("\n\n")[0]).parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    config = TrainConfig(learning_rate=1e-3)
    sides, tokenizer = trainers({"rank_products": config, "plain": config})
    trainer, _ = sides["plain"]
    sides["plain"] = (_PlainSide(trainer), config)  # type: ignore[assignment]
    seconds, first = alternate_steps(sides, tokenizer, args)
    print(f"first step: rank_products {first['rank_products']}, plain {first['plain']}")
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    speedup = medians["plain"] / medians["rank_products"]
    print(f"median step: rank_products {medians['rank_products']:.2f} s, plain {medians['plain']:.2f} s: "
          f"{speedup:.2f}x (load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f})")
    print(json.dumps({"lora_products_speedup": round(speedup, 3), "median_s": medians, "step_s": seconds,
                      "first_step": first, "threads": args.threads}))


if __name__ == "__main__":
    main()
