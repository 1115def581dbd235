"""One GRPO step shared by several processes: how ranks agree on normalisers and gradients.

A step's groups are split across ranks by tokens (``split_groups_by_tokens``). Each rank runs
``GRPOTrainer.train_step`` on its share with a ``StepSync``, which

1. sums the step's sequence and token counts over the ranks, so every rank normalises its loss by the
   totals of the whole step (the losses divide by them), and
2. sums the LoRA gradients over the ranks after the last backward pass, before clipping.

Every rank then holds the gradient one process would have computed on all the groups (up to the order
of float additions), clips it identically and takes the same AdamW step: the ranks' adapters stay equal,
as under DDP. torch's ``DistributedDataParallel`` wrapper is not used because it reduces inside each
backward call and needs the same number of them on every rank; a token-balanced split gives ranks
different numbers of micro-batches, so the one reduction per step is done here, as DDP's ``no_sync()``
followed by a final synchronised backward would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from ..types import TrajectoryGroup

__all__ = ["StepSync", "TorchDistributedSync", "group_tokens", "split_groups_by_tokens"]


@runtime_checkable
class StepSync(Protocol):
    """What ``GRPOTrainer.train_step(sync=...)`` needs from the ranks it shares a step with."""

    def sum(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks (every rank gets the sums)."""
        ...

    def gradients(self, params: Sequence[torch.Tensor]) -> None:
        """Sum ``params``' gradients over the ranks, in place (a missing gradient counts as zeros)."""
        ...


class TorchDistributedSync:
    """``StepSync`` over the default ``torch.distributed`` process group (gloo on CPU, nccl on GPU).

    Every rank must call ``train_step`` for every step, even with no group of its own: the collectives
    are matched by order.
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("TorchDistributedSync needs torch.distributed.init_process_group() first")
        self._dist = dist
        self.world_size = dist.get_world_size()

    def sum(self, values: list[float]) -> list[float]:
        device = "cuda" if self._dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor(values, dtype=torch.float64, device=device)  # float64: token counts stay exact
        self._dist.all_reduce(t)
        return t.tolist()

    def gradients(self, params: Sequence[torch.Tensor]) -> None:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # One flat buffer, one collective: a LoRA adapter is small, many tiny all_reduces cost more.
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self._dist.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n


def group_tokens(group: TrajectoryGroup) -> int:
    """The tokens a group puts through the model: prompt and completion of every recorded call."""
    return sum(len(c.prompt_token_ids) + len(c.completion_token_ids) for t in group.trajectories for c in t.calls)


def split_groups_by_tokens(groups: Sequence[TrajectoryGroup], ranks: int) -> list[list[int]]:
    """Indices of ``groups`` per rank, balancing tokens (largest group first, to the lightest rank).

    Groups stay whole: GRPO's advantages are relative within a group.

    Returns:
        ``ranks`` lists of group indices (a list may be empty when there are fewer groups than ranks).
    """
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    load = [0] * ranks
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(groups)), key=lambda i: -group_tokens(groups[i])):
        r = min(range(ranks), key=lambda r: (load[r], len(shares[r])))
        shares[r].append(i)
        load[r] += max(group_tokens(groups[i]), 1)
    return [sorted(s) for s in shares]
