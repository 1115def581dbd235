"""Learning-rate schedules over the optimizer steps of one supervised fine-tuning call.

A GRPO step is one optimizer step at a fixed rate; an SFT step (``SFTConfig``) is many (epochs x batches), and
its rate follows a schedule over them: a linear warmup, then constant, linear decay to zero, or a half cosine
to zero, the shapes of transformers' ``get_*_schedule_with_warmup``. The schedule spans one call: a second
``train_sft`` starts it again.
"""

from __future__ import annotations

import math
from typing import Literal

__all__ = ["learning_rates"]


def learning_rates(peak: float, steps: int, *, schedule: Literal["constant", "linear", "cosine"],
                   warmup_ratio: float = 0.0) -> list[float]:
    """The rate of each of ``steps`` optimizer steps.

    Warmup: the first ``ceil(warmup_ratio * steps)`` steps ramp up as ``peak * (s + 1) / (warmup + 1)`` (never 0:
    a step at rate 0 would be a wasted pass). Decay: from ``peak`` at the first step after the warmup toward 0,
    as transformers does, so the last step's rate is small but not 0.

    Example: ``learning_rates(1.0, 4, schedule="linear")`` is ``[1.0, 0.75, 0.5, 0.25]``.
    """
    warmup = math.ceil(warmup_ratio * steps)
    rates = []
    for s in range(steps):
        if s < warmup:
            rates.append(peak * (s + 1) / (warmup + 1))
            continue
        progress = (s - warmup) / max(1, steps - warmup)  # 0 at the first decayed step, < 1 at the last
        if schedule == "linear":
            factor = 1.0 - progress
        elif schedule == "cosine":
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            factor = 1.0
        rates.append(peak * factor)
    return rates
