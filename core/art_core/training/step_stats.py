"""A training step's running sums, and the step's metrics made from them.

The sums stay tensors on the device during the step and are read once, at its end (``StepStats.read``):
reading a value waits for the device, and doing so per micro-batch would stall every step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .samples import Sample

__all__ = ["StepStats", "sft_metrics", "step_metrics"]


class StepStats:
    """A step's running sums, kept as tensors on the device; read once, at the end of the step.

    Reading a tensor's value (``.item()``) waits for the device to finish its queued work; doing it a dozen
    times per micro-batch stalls every step. Here each micro-batch only adds tensors, and ``read()`` is the
    step's one sync point.
    """

    def __init__(self, device: torch.device) -> None:
        zero = torch.zeros((), device=device)
        self.losses: list[torch.Tensor] = []  # one 0-dim loss per micro-batch, to name the first non-finite one
        self.sums: dict[str, torch.Tensor] = {}
        self.entropy = zero.clone()
        self.sampler_diff = zero.clone()
        self.sampler_tokens = zero.clone()
        self.sampler_max = zero.clone()
        self.ratio_max = torch.full((), -math.inf, device=device)
        self.ratio_min = torch.full((), math.inf, device=device)

    def add(self, loss: torch.Tensor, stats: dict[str, torch.Tensor], entropy: torch.Tensor | None,
            mask: torch.Tensor, logprobs: torch.Tensor, sampler_logprobs: torch.Tensor) -> None:
        """One micro-batch's loss, its loss stats, and its per-token tensors (``[B, T]``)."""
        self.losses.append(loss.detach())
        for key, value in stats.items():
            if key == "ratio_max":
                self.ratio_max = torch.maximum(self.ratio_max, value)
            elif key == "ratio_min":
                self.ratio_min = torch.minimum(self.ratio_min, value)
            else:
                self.sums[key] = self.sums.get(key, 0.0) + value
        if entropy is not None:
            self.entropy += (entropy.detach() * mask).sum()
        known = (mask > 0) & ~torch.isnan(sampler_logprobs)  # [B, T] tokens the sampler reported a logprob for
        gap = torch.where(known, (logprobs.detach() - sampler_logprobs).abs(), torch.zeros_like(logprobs))
        self.sampler_diff += gap.sum()
        self.sampler_max = torch.maximum(self.sampler_max, gap.max())
        self.sampler_tokens += known.sum()

    def read(self, grad_norm: torch.Tensor) -> dict[str, Any]:
        """The sums and ``grad_norm`` as Python numbers: the step's one device sync.

        Returns:
            ``losses`` (one per micro-batch), ``grad_norm``, ``entropy``, ``sampler_diff``, ``sampler_tokens``,
            ``sampler_max``, ``ratio_max``, ``ratio_min`` and the loss's summed stats by name.
        """
        keys = sorted(self.sums)
        scalars = [grad_norm, self.entropy, self.sampler_diff, self.sampler_tokens, self.sampler_max, self.ratio_max,
                   self.ratio_min, *(self.sums[k] for k in keys)]
        device = self.entropy.device
        values = torch.stack([*self.losses, *(t.float().to(device) for t in scalars)]).tolist()  # the sync
        losses, rest = values[: len(self.losses)], values[len(self.losses) :]
        grad, entropy, diff, known, sampler_max, ratio_max, ratio_min, *sums = rest
        return {"losses": losses, "grad_norm": grad, "entropy": entropy, "sampler_diff": diff,
                "sampler_tokens": known, "sampler_max": sampler_max, "ratio_max": ratio_max, "ratio_min": ratio_min,
                **dict(zip(keys, sums, strict=True))}


def step_metrics(totals: dict[str, Any], samples: list[Sample], *, num_sequences: int, num_tokens: int,
                 forward_tokens: int, micro_batches: int) -> dict[str, float]:
    """The metrics of an applied step, from ``StepStats.read``'s totals (per-token means over ``num_tokens``)."""
    per_token = max(num_tokens, 1)
    return {
        "trained": 1.0,
        "loss": math.fsum(totals["losses"]),
        "samples": float(num_sequences),
        "samples_rerendered": float(sum(s.rerendered for s in samples)),
        "samples_off_policy": float(sum(s.behaviour_logprobs is not None for s in samples)),
        "trained_tokens": float(num_tokens),
        "forward_tokens": float(forward_tokens),
        "micro_batches": float(micro_batches),
        "entropy": totals["entropy"] / per_token,
        "ratio_mean": totals.get("ratio_sum", 0.0) / per_token,
        "ratio_max": totals["ratio_max"] if totals["ratio_max"] > -math.inf else 1.0,
        "ratio_min": totals["ratio_min"] if totals["ratio_min"] < math.inf else 1.0,
        "clip_fraction": totals.get("clipped_tokens", 0.0) / per_token,
        "kl": totals.get("kl_sum", 0.0) / per_token,
        "is_weight_mean": totals.get("is_weight_sum", 0.0) / per_token,
        "is_truncated_fraction": totals.get("is_truncated_tokens", 0.0) / per_token,
        "sampler_logprob_abs_diff": totals["sampler_diff"] / totals["sampler_tokens"] if totals["sampler_tokens"]
        else math.nan,
        "sampler_logprob_max_abs_diff": totals["sampler_max"] if totals["sampler_tokens"] else math.nan,
        "grad_norm": totals["grad_norm"],
    }


def sft_metrics(step_totals: list[dict[str, Any]], samples: list[Sample], *, rates: list[float], epochs: int,
                num_sequences: int, num_tokens: int, forward_tokens: int, micro_batches: int) -> dict[str, float]:
    """The metrics of a supervised step: its optimizer steps' ``StepStats.read`` totals, one per step.

    ``loss`` is the mean of the optimizer steps' losses (each the token-mean NLL of the assistant tokens of its
    batch); ``loss_first`` and ``loss_last`` bracket the pass. ``samples`` and ``trained_tokens`` count one
    epoch; ``forward_tokens`` and ``micro_batches`` every epoch.
    """
    losses = [math.fsum(t["losses"]) for t in step_totals]
    norms = [t["grad_norm"] for t in step_totals]
    return {
        "trained": 1.0,
        "loss": math.fsum(losses) / len(losses),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "optimizer_steps": float(len(losses)),
        "epochs": float(epochs),
        "samples": float(num_sequences),
        "samples_rerendered": float(sum(s.rerendered for s in samples)),
        "trained_tokens": float(num_tokens),
        "forward_tokens": float(forward_tokens),
        "micro_batches": float(micro_batches),
        "entropy": math.fsum(t["entropy"] for t in step_totals) / max(num_tokens * epochs, 1),
        "grad_norm": norms[-1],
        "grad_norm_max": max(norms),
        "learning_rate": max(rates),
        "learning_rate_last": rates[-1],
    }
