"""The trainer group: long-lived rank actors in one placement group, sharing each GRPO step.

    driver: split groups by tokens -> rank 0..M-1: GRPOTrainer.train_step(share, sync=TorchDistributedSync())
            <- rank 0: the step's checkpoint files; every rank: its metrics (merged here)

A supervised step (``SFTConfig``) is several optimizer steps that every rank must take together, so each rank
gets every group and trains its slice of each batch (``GRPOTrainer.train_step``'s ``shard``).

Ranks run ``torch.distributed`` (gloo on CPU, nccl on GPU). Each holds the whole PEFT model; the step's
gradient is summed over ranks once per step (``training/distributed.py`` says why not the DDP wrapper),
so the ranks' adapters stay identical and equal to what one process would train, up to float
reduction order. With ``sharding="fsdp"`` (or ``"auto"`` and a base over half a GPU) FSDP2 shards the
frozen base over the ranks; the adapter stays whole on each (``training/distributed.py``: ``shard_policy``).
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from ...config import LoraSettings, SFTConfig, TrainConfig, step_config
from ...errors import ConfigError, TrajectoryError
from ...training.distributed import split_groups_by_tokens
from ...types import TrajectoryGroup

__all__ = ["TrainerGroup", "TrainerRank", "merge_rank_metrics"]

_SHARDINGS = ("none", "fsdp", "auto")
# Metrics each rank reports as its part of a whole-step value (trainer.py divides by the step's totals).
_SUMMED = ("loss", "entropy", "ratio_mean", "clip_fraction", "kl", "is_weight_mean", "is_truncated_fraction",
           "forward_tokens", "micro_batches", "samples_rerendered", "samples_off_policy", "loss_first", "loss_last")


class TrainerRank:
    """One rank of the trainer group (a Ray actor; see the module docstring).

    Args:
        rank: this rank's index.
        world_size: ranks in the group.
        base_dir: the base model: a registered name or a folder on this node.
        lora: the adapter's shape (``LoraSettings`` as a dict).
        checkpoint: files of the checkpoint to resume from (adapter and optimizer), or None for a fresh one.
        num_threads: torch threads for this rank (None: torch's default).
    """

    def __init__(self, *, rank: int, world_size: int, base_dir: str, lora: dict[str, Any],
                 checkpoint: dict[str, bytes] | None, num_threads: int | None = None) -> None:
        import torch

        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.rank, self.world_size = rank, world_size
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self._base_dir, self._lora, self._checkpoint = base_dir, lora, checkpoint
        self._scratch = Path(tempfile.mkdtemp(prefix=f"art-rank{rank}-"))
        self.sharded = False

    def _load(self, sharded: bool) -> None:
        """Load the policy: whole on this rank's device, or on the CPU and then sharded with FSDP2."""
        from ...models import resolve_base_model
        from ...training.distributed import shard_policy
        from ...training.loading import load_policy
        from ...training.trainer import GRPOTrainer

        resume = _write(self._scratch / "resume", self._checkpoint) if self._checkpoint else None
        policy, tokenizer = load_policy(resolve_base_model(self._base_dir), LoraSettings.model_validate(self._lora),
                                        device="cpu" if sharded else self.device, adapter_dir=resume)
        if sharded:
            shard_policy(policy)  # FSDP2 moves its shards to the device; a shared prefix would be a pass of its own
        self.sharded = sharded
        self.trainer = GRPOTrainer(policy, tokenizer, share_prefix=not sharded)
        if resume is not None:
            self.trainer.load_optimizer_state(resume)
        self._names = [name for name, p in policy.named_parameters() if p.requires_grad]
        self._checkpoint = None  # loaded: the bytes are not needed any more

    def rendezvous(self) -> tuple[str, int]:
        """An address and free port on this node for the group's rendezvous (asked of rank 0)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join(self, address: str, port: int, timeout_s: float, sharding: str = "none") -> bool:
        """Join the process group, load the policy (sharded or not: the ranks agree), then take rank 0's
        adapter so every rank starts from the same weights. Returns whether the base is sharded."""
        import torch
        import torch.distributed as dist

        backend = "nccl" if self.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=self.rank,
                                world_size=self.world_size, timeout=timedelta(seconds=timeout_s))
        wish = sharding == "fsdp" or (sharding == "auto" and self.world_size > 1 and _too_big_for_device(
            self._base_dir, self.device))
        vote = torch.tensor([int(wish)], device=self.device)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX)  # one rank whose device is too small shards them all
        self._load(bool(vote.item()))
        with torch.no_grad():  # a fresh LoRA A is random per process
            for p in self.trainer.params:
                dist.broadcast(p.data, src=0)
        return self.sharded

    def train(self, groups: list[dict[str, Any]], config: dict[str, Any], *, policy_step: int | None = None,
              return_gradients: bool = False, return_checkpoint: bool = False) -> dict[str, Any]:
        """One step on this rank's share (``policy_step``: ``GRPOTrainer.train_step``'s); returns its metrics (and
        the checkpoint files, the gradients if asked)."""
        import warnings

        from ...training.distributed import ShardedSync, TorchDistributedSync

        settings = step_config(config)  # TrainConfig or SFTConfig, by its kind
        inner = (ShardedSync(self.trainer.model, reference_pass=config.get("beta", 0) > 0) if self.sharded
                 else TorchDistributedSync())
        sync = _RecordingSync(inner, record=return_gradients)
        shard = (self.rank, self.world_size) if isinstance(settings, SFTConfig) else None
        with warnings.catch_warnings(record=True) as caught:  # the driver warns once, for the whole step
            warnings.simplefilter("always")
            metrics = self.trainer.train_step([TrajectoryGroup.model_validate(g) for g in groups],
                                              settings, sync=sync, shard=shard, policy_step=policy_step)
        out: dict[str, Any] = {"metrics": metrics, "warnings": [str(w.message) for w in caught]}
        if return_gradients:
            out["gradients"] = dict(zip(self._names, sync.recorded, strict=True))
        if return_checkpoint and metrics.get("trained"):
            folder = self._scratch / "last"
            folder.mkdir(parents=True, exist_ok=True)
            self.trainer.save(folder)
            out["checkpoint"] = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
        return out

    def prepare(self, config: dict[str, Any]) -> None:
        """``GRPOTrainer.prepare`` for ``config`` (a ``TrainConfig`` or ``SFTConfig``'s JSON)."""
        self.trainer.prepare(step_config(config))

    def adapter(self) -> dict[str, bytes]:
        """This rank's adapter files (``adapter_config.json``, weights) as bytes."""
        folder = self._scratch / "adapter"
        folder.mkdir(parents=True, exist_ok=True)
        self.trainer.model.save_pretrained(folder)
        return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name.startswith("adapter_")}

    def leave(self) -> None:
        """Leave the process group and remove this rank's temporary folder (``ray.kill`` runs no finalizer)."""
        import torch.distributed as dist

        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            shutil.rmtree(self._scratch, ignore_errors=True)


class _RecordingSync:
    """A ``StepSync`` that can keep a copy of the summed gradients (to compare ranks with one process)."""

    def __init__(self, inner: Any, *, record: bool) -> None:
        self.inner, self.record, self.recorded = inner, record, []

    def sum(self, values: list[float]) -> list[float]:
        return self.inner.sum(values)  # type: ignore[no-any-return]

    def planned(self, micro_batches: int) -> None:
        if hasattr(self.inner, "planned"):  # a sharded group agrees on its pass count
            self.inner.planned(micro_batches)

    def gradients(self, params: Sequence[Any]) -> None:
        self.inner.gradients(params)
        if self.record:
            self.recorded = [p.grad.detach().cpu().numpy().copy() for p in params]


class TrainerGroup:
    """``TrainerRank`` actors in one placement group (started by ``TrainerGroup.start``).

    Attributes:
        ranks: the actor handles, rank 0 first.
        placement_group: the Ray placement group holding them.
        sharded: whether FSDP2 shards the base model over the ranks.
    """

    def __init__(self, ranks: list[Any], placement_group: Any) -> None:
        self.ranks = ranks
        self.placement_group = placement_group
        self.sharded = False
        """Whether the ranks shard the base model with FSDP2."""

    @classmethod
    async def start(cls, *, workers: int, base_dir: str, lora: LoraSettings, checkpoint: dict[str, bytes] | None,
                    num_threads: int | None, gpus_per_rank: float, cpus_per_rank: float,
                    extra: dict[str, float] | None = None, strategy: str = "PACK",
                    timeout_s: float = 600, sharding: str = "auto") -> TrainerGroup:
        """Reserve one bundle per rank, start the ranks, and join them into one process group.

        ``sharding``: ``"none"`` (each rank holds the whole model), ``"fsdp"`` (FSDP2 shards the frozen
        base over the ranks) or ``"auto"`` (FSDP2 when the base's weights take more than half of one GPU).
        """
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if workers < 1:
            raise ConfigError(f"trainer_workers must be at least 1, got {workers}")
        if sharding not in _SHARDINGS:
            raise ConfigError(f"sharding={sharding!r} is not one of {', '.join(map(repr, _SHARDINGS))}")
        bundle = {"CPU": cpus_per_rank, **({"GPU": gpus_per_rank} if gpus_per_rank else {}), **(extra or {})}
        pg = placement_group([dict(bundle) for _ in range(workers)], strategy=strategy)
        try:
            async with asyncio.timeout(timeout_s):  # not wait_for: on 3.11 it can swallow a cancellation
                await pg.ready()
        except TimeoutError as exc:
            ray.util.remove_placement_group(pg)
            raise ConfigError(f"the cluster cannot place {workers} trainer rank(s) of {bundle} each "
                              f"(strategy {strategy}) within {timeout_s:.0f} s: add nodes or lower trainer_workers"
                              ) from exc
        actor = ray.remote(TrainerRank)
        ranks = [actor.options(num_cpus=cpus_per_rank, num_gpus=gpus_per_rank, resources=extra or None,
                               scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
                               ).remote(rank=i, world_size=workers, base_dir=base_dir, lora=lora.model_dump(),
                                        checkpoint=checkpoint, num_threads=num_threads)
                 for i in range(workers)]
        address, port = await ranks[0].rendezvous.remote()
        sharded = await asyncio.gather(*(r.join.remote(address, port, timeout_s, sharding) for r in ranks))
        group = cls(ranks, pg)
        group.sharded = bool(sharded[0])
        return group

    async def prepare(self, config: TrainConfig | SFTConfig) -> None:
        """Every rank makes what a first step under ``config`` would make at its start (``GRPOTrainer.prepare``)."""
        await asyncio.gather(*(rank.prepare.remote(config.model_dump(mode="json")) for rank in self.ranks))

    async def adapter(self) -> dict[str, bytes]:
        """Rank 0's adapter files (every rank holds the same)."""
        return await self.ranks[0].adapter.remote()  # type: ignore[no-any-return]

    async def train(self, groups: Sequence[TrajectoryGroup], config: TrainConfig | SFTConfig, *,
                    policy_step: int | None = None, return_gradients: bool = False) -> dict[str, Any]:
        """One step over all ranks (GRPO: each rank a share of the groups; SFT: each rank a slice of every batch).

        ``policy_step`` is the checkpoint the ranks' modules are at (``GRPOTrainer.train_step``'s): each rank drops
        its share's groups past ``config.max_off_policy``, and the merged metrics count staleness over all groups.

        Returns:
            ``metrics`` (merged over ranks), ``checkpoint`` (rank 0's files, when trained), ``shares`` (group
            indices per rank), ``warnings``, and per rank ``gradients`` when asked.

        Raises:
            TrajectoryError: a group is empty or a call is longer than ``config.max_sequence_length``
                (checked here, before any rank starts: a rank failing alone would leave the others waiting).
        """
        _check_groups(groups, config)
        # Sharded ranks run without prefix sharing (ShardedSync), so the shared prompts then count in full.
        if isinstance(config, SFTConfig):  # every rank takes every optimizer step, on its slice of each batch
            shares = [list(range(len(groups))) for _ in self.ranks]
        else:
            shares = split_groups_by_tokens(groups, len(self.ranks),
                                            share_prefix=config.share_prefix and not self.sharded)
        config_data = config.model_dump(mode="json")
        replies = await asyncio.gather(*(
            rank.train.remote([groups[i].model_dump(mode="json") for i in share], config_data,
                              policy_step=policy_step, return_gradients=return_gradients,
                              return_checkpoint=r == 0)
            for r, (rank, share) in enumerate(zip(self.ranks, shares, strict=True))))
        metrics = merge_rank_metrics([reply["metrics"] for reply in replies], groups,
                                     every_rank_all_groups=isinstance(config, SFTConfig))
        if policy_step is not None and isinstance(config, TrainConfig):  # each rank counted its share only
            from ...training.staleness import staleness

            for key in [k for k in metrics if k.startswith(("groups_stale", "staleness_"))]:
                del metrics[key]
            metrics.update(staleness(groups, policy_step, config.max_off_policy).metrics())
        result: dict[str, Any] = {"metrics": metrics, "checkpoint": replies[0].get("checkpoint"), "shares": shares,
                                  "warnings": sorted({w for reply in replies for w in reply["warnings"]})}
        if return_gradients:
            result["gradients"] = [reply["gradients"] for reply in replies]
        return result

    async def aclose(self) -> None:
        import ray

        await asyncio.gather(*(r.leave.remote() for r in self.ranks), return_exceptions=True)
        for r in self.ranks:
            ray.kill(r)
        ray.util.remove_placement_group(self.placement_group)


def merge_rank_metrics(per_rank: list[dict[str, float]], groups: Sequence[TrajectoryGroup], *,
                       every_rank_all_groups: bool = False) -> dict[str, float]:
    """One step's metrics from its ranks' (each rank saw only its share of the groups, or, with
    ``every_rank_all_groups`` (SFT), every group and its slice of each batch)."""
    import math

    from ...training.trainer import _mean, _std

    merged = dict(per_rank[0])
    rewards = [r for g in groups for r in g.rewards]
    merged.update(reward_mean=_mean(rewards), reward_std=_std(rewards), groups=float(len(groups)),
                  groups_used=per_rank[0]["groups_used"] if every_rank_all_groups
                  else sum(m["groups_used"] for m in per_rank),
                  groups_dropped=sum(m["groups_dropped"] for m in per_rank),
                  trajectories=float(sum(len(g) for g in groups)),
                  rollout_exceptions=float(sum(len(g.exceptions) for g in groups)), ranks=float(len(per_rank)))
    if not merged.get("trained"):
        return merged
    for key in _SUMMED:
        merged[key] = sum(m.get(key, 0.0) for m in per_rank)
    merged["ratio_max"] = max(m.get("ratio_max", 1.0) for m in per_rank)
    merged["ratio_min"] = min(m.get("ratio_min", 1.0) for m in per_rank)
    diffs = [m["sampler_logprob_abs_diff"] for m in per_rank if not math.isnan(m.get("sampler_logprob_abs_diff", math.nan))]
    merged["sampler_logprob_abs_diff"] = sum(diffs) / len(diffs) if diffs else math.nan
    for key in [k for k in merged if k.startswith("seconds_")]:
        merged[key] = max(m.get(key, 0.0) for m in per_rank)  # ranks run side by side: the slowest sets the pace
    return merged


def _check_groups(groups: Sequence[TrajectoryGroup], config: TrainConfig | SFTConfig) -> None:
    for i, group in enumerate(groups):
        if len(group) == 0:
            raise TrajectoryError(f"group {i} is empty: every rollout of it failed or none was run "
                                  f"({len(group.exceptions)} exception(s) recorded); drop it before training")
        for t in group.trajectories:
            for call in t.calls:
                length = len(call.prompt_token_ids) + len(call.completion_token_ids)
                if length > config.max_sequence_length:
                    raise TrajectoryError(
                        f"trajectory {t.id!r} (group {i}) has a call of {length} tokens, over "
                        f"max_sequence_length={config.max_sequence_length}; raise the limit or shorten the rollout")


def _too_big_for_device(base_dir: str, device: str) -> bool:
    """Whether the base model's weight files take more than half of one GPU's memory (never on the CPU,
    where the ranks of a node share its memory and sharding would not give any of them more)."""
    import torch

    from ...models import resolve_base_model

    if device != "cuda":
        return False
    folder = resolve_base_model(base_dir)
    weights = sum(p.stat().st_size for p in Path(folder).glob("*") if p.suffix in (".safetensors", ".bin"))
    return weights > 0.5 * torch.cuda.get_device_properties(0).total_memory


def _write(folder: Path, files: dict[str, bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder
