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

__all__ = ["ShardedSync", "StepSync", "TorchDistributedSync", "group_tokens", "shard_policy", "split_groups_by_tokens"]


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


def group_tokens(group: TrajectoryGroup, *, share_prefix: bool = False, min_shared_prefix: int = 16) -> int:
    """The tokens a group puts through the model: prompt and completion of every recorded call.

    With ``share_prefix`` (the trainer's default, ``TrainConfig.share_prefix``), the prompt the group's calls
    share is run once (``training/batching.py``), so it counts once: a group of 8 rollouts of one 500-token
    prompt with 20-token answers costs about 660 tokens of forward work, not 4160, and the answers'
    lengths, not the prompt's repetitions, decide how heavy it is.
    """
    calls = [c for t in group.trajectories for c in t.calls]
    total = sum(len(c.prompt_token_ids) + len(c.completion_token_ids) for c in calls)
    if not share_prefix or len(calls) < 2:
        return total
    first, shared = calls[0].prompt_token_ids, min(len(c.prompt_token_ids) for c in calls)
    for c in calls[1:]:
        i = 0
        while i < shared and c.prompt_token_ids[i] == first[i]:
            i += 1
        shared = i
    return total - shared * (len(calls) - 1) if shared >= min_shared_prefix else total


def split_groups_by_tokens(groups: Sequence[TrajectoryGroup], ranks: int, *,
                           share_prefix: bool = False) -> list[list[int]]:
    """Indices of ``groups`` per rank, balancing tokens (largest group first, to the lightest rank).

    Groups stay whole: GRPO's advantages are relative within a group.

    Args:
        groups: the step's groups.
        ranks: how many ranks share the step.
        share_prefix: whether the ranks run each group's shared prompt once (see ``group_tokens``).

    Returns:
        ``ranks`` lists of group indices (a list may be empty when there are fewer groups than ranks).
    """
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    cost = [max(group_tokens(g, share_prefix=share_prefix), 1) for g in groups]
    load = [0] * ranks
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(groups)), key=lambda i: -cost[i]):
        r = min(range(ranks), key=lambda r: (load[r], len(shares[r])))
        shares[r].append(i)
        load[r] += cost[i]
    return [sorted(s) for s in shares]


# --- FSDP2: the frozen base sharded over the ranks, the LoRA adapter whole on each ---------------------

def shard_policy(model: torch.nn.Module) -> int:
    """Shard a PEFT model's frozen base weights over the default process group with FSDP2 (``fully_shard``).

    Each decoder layer is one FSDP unit, and the model (embeddings, final norm, head) is the root unit: a
    rank holds ``1/world_size`` of the base and all-gathers one layer at a time in the forward and backward
    passes. The trainable LoRA parameters are left out of FSDP (``ignored_params``): they are small, stay
    whole on every rank, and their gradients are summed by ``ShardedSync`` like ``TorchDistributedSync`` does,
    so the adapter, its checkpoint and the optimizer are the same as in the replicated group.

    Call it after ``init_process_group`` and before the first forward pass, on every rank.

    Args:
        model: a PEFT model (``load_policy``), loaded on the CPU.

    Returns:
        The number of decoder layers sharded as units of their own.

    Raises:
        ValueError: the model has no decoder layer FSDP can wrap (its ``_no_split_modules`` names none).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # the transformers model
    names = set(getattr(inner, "_no_split_modules", None) or [])
    layers = [m for m in inner.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"cannot shard {type(inner).__name__}: no decoder layer class among {sorted(names)}")
    lora = {p for p in model.parameters() if p.requires_grad}
    for layer in layers:
        fully_shard(layer, mesh=mesh, ignored_params=lora & set(layer.parameters()))
    fully_shard(inner, mesh=mesh, ignored_params=lora)
    if device == "cuda":  # FSDP moves what it shards; the ignored LoRA parameters move here
        for p in lora:
            p.data = p.data.to(device)
    return len(layers)


class ShardedSync(TorchDistributedSync):
    """``StepSync`` for a group sharded with ``shard_policy``: the ranks run the same number of passes.

    Every forward and backward pass of an FSDP model all-gathers each layer's shards, a collective every
    rank must join in the same order. A token-balanced split gives ranks different numbers of
    micro-batches, so before its loop each rank tells ``planned`` how many it will run; the ranks agree on
    the largest count, and in ``gradients`` the ranks with fewer run the difference as zero-loss passes on
    one token (their gradient contribution is exactly zero) before the adapter's gradients are summed.
    ``GRPOTrainer`` must run with ``share_prefix=False`` (a shared prefix's backward is a pass of its own,
    at a point that differs between ranks).

    Args:
        model: the sharded PEFT model.
        reference_pass: the step computes reference log-probs (``config.beta > 0``): each micro-batch is a
            forward with gradients, a forward without, then a backward, and so is each padding pass.
    """

    def __init__(self, model: torch.nn.Module, *, reference_pass: bool) -> None:
        super().__init__()
        self.model, self.reference_pass = model, reference_pass
        self._mine = self._most = 0

    def planned(self, micro_batches: int) -> None:
        """This rank will run ``micro_batches``; agree on the most any rank runs (called before the loop)."""
        t = torch.tensor([micro_batches], dtype=torch.int64, device=self._device())
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX)
        self._mine, self._most = micro_batches, int(t.item())

    def gradients(self, params: Sequence[torch.Tensor]) -> None:
        ids = torch.zeros(1, 1, dtype=torch.long, device=self._device())
        for _ in range(self._most - self._mine):
            out = self.model(input_ids=ids, use_cache=False)
            if self.reference_pass:
                with torch.no_grad(), self.model.disable_adapter():
                    self.model(input_ids=ids, use_cache=False)
            (out.logits.float().sum() * 0.0).backward()
        super().gradients(params)

    def _device(self) -> str:
        return "cuda" if self._dist.get_backend() == "nccl" else "cpu"
