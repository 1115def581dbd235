"""One GRPO step of the demo's shape with pre-packed base weights (``TrainConfig.prepacked_base_weights``) and
without, side by side.

The work is ``packed_groups.py``'s: ``--groups`` groups (default 4) of ``--group-size`` completions (default 8) of
``--completion-tokens`` seeded random tokens (default 12) behind the demo's questions, distinct rewards. Both sides
train the embedded SmolLM2-135M with the same fresh LoRA adapter (a trainer each, loaded from the same weights),
``TrainConfig(learning_rate=1e-3)`` and the default packed groups:

- ``prepacked``: ``prepacked_base_weights=True``: the LoRA layers' base products and the LM head's, forward and input
  gradient, through oneDNN on copies of the frozen weights reordered once into its blocked layout
  (``training/fused_lora.py``);
- ``plain``: PyTorch's matmuls on the weights themselves (MKL on CPU), the default.

``--base-matmul-dtype bfloat16`` runs both sides with bf16 base matmuls (then ``prepacked`` packs bf16 copies).
Timed: ``GRPOTrainer.train_step``, in this process, ``--threads`` torch threads (default 1, as a Ray trainer rank
has); the sides alternate step by step, ``--steps`` timed steps each after one warm-up (which makes the copies).
Checked and printed: the same forward tokens each step; the first step's loss and gradient norm, to rounding; the
memory the copies take.

    PYTHONPATH=core python tests/benchmarks/prepacked_base.py [--steps 6] [--threads 1] [--base-matmul-dtype bfloat16]

The last line is a JSON object: ``prepacked_speedup`` (median plain over median prepacked), each side's medians,
every step's seconds, ``copies_mb``.
"""

from __future__ import annotations

import json
import os
import statistics

import torch
from packed_groups import alternate_steps, step_shape_parser, trainers  # this folder's: the same step

from art_core import TrainConfig
from art_core.training.trainer import GRPOTrainer


def _copies_mb(trainer: GRPOTrainer) -> float:
    """Memory the trainer's base-weight copies hold (their packed or cast tensors)."""
    return sum(copy.nbytes for _, _, copy in trainer._base_copies.values()) / 2**20


def main() -> None:
    parser = step_shape_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--base-matmul-dtype", choices=["bfloat16"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()

    sides, tokenizer = trainers({
        name: TrainConfig(learning_rate=1e-3, prepacked_base_weights=name == "prepacked",
                          base_matmul_dtype=args.base_matmul_dtype)
        for name in ("prepacked", "plain")})
    seconds, first = alternate_steps(sides, tokenizer, args)  # step 0 also makes the copies
    copies = {name: round(_copies_mb(trainer), 1) for name, (trainer, _) in sides.items()}
    print(f"first step: prepacked {first['prepacked']}, plain {first['plain']}")
    print(f"base-weight copies: prepacked {copies['prepacked']} MiB, plain {copies['plain']} MiB")
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    speedup = medians["plain"] / medians["prepacked"]
    print(f"median step: prepacked {medians['prepacked']:.2f} s, plain {medians['plain']:.2f} s: {speedup:.2f}x")
    print(json.dumps({"prepacked_speedup": round(speedup, 3), "median_seconds": medians, "seconds": seconds,
                      "first_step": first, "copies_mb": copies, "load_before": load_before,
                      "load_after": os.getloadavg(), "settings": vars(args)}))


if __name__ == "__main__":
    main()
