"""One GRPO step on a LoRA adapter: records -> samples -> advantages -> loss -> optimizer step.

``GRPOTrainer`` owns the PEFT model and its optimizer. ``train_step`` reads top to bottom as the five
phases of a step; the orchestration around it (writing trajectories before the step, checkpoints and
history after it) lives in ``backends/local.py``.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..config import TrainConfig
from ..errors import TrainingError, TrajectoryError
from ..types import TrajectoryGroup
from .advantages import compute_group_advantages
from .batching import plan_micro_batches
from .distributed import StepSync
from .forward import SharedPrefix, micro_batch_logprobs
from .loading import load_policy  # re-exported: its home before training/loading.py
from .losses import LossInputs, build_loss
from .samples import Sample, trajectory_samples

__all__ = ["GRPOTrainer", "ZeroVarianceGroupsWarning", "check_config", "load_policy"]

StepMetrics = dict[str, float]
Progress = Callable[[int, int], None]


class ZeroVarianceGroupsWarning(UserWarning):
    """Some groups had equal rewards for every trajectory: they carry no signal and were dropped."""


def check_config(config: TrainConfig) -> None:
    """Check what ``TrainConfig`` cannot check by itself (the loss and its ``loss_options``), before any work.

    Raises:
        ConfigError: the loss refuses an option or a value (the message names it and lists the accepted ones).
    """
    build_loss(config.loss, beta=config.beta, tis_cap=config.tis_cap, **config.loss_options)


class _StepStats:
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


class GRPOTrainer:
    """Trains one LoRA adapter with GRPO.

    Args:
        model: a PEFT model whose adapter parameters are trainable.
        tokenizer: its tokenizer (used for re-rendering histories recorded without token ids).
        share_prefix: allow ``TrainConfig.share_prefix`` (a group's prompt run once, its KV cache reused with
            gradients). False for models whose forward cannot take that cache (Unsloth's); default True.
    """

    def __init__(self, model: Any, tokenizer: Any, *, share_prefix: bool = True) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.share_prefix = share_prefix
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise TrainingError("the model has no trainable parameter: was the adapter loaded with is_trainable=True?")
        self.optimizer: torch.optim.Optimizer | None = None
        # AdamW state read from a checkpoint; applied when the optimizer is built at the first step.
        self._pending_optimizer_state: dict[str, Any] | None = None

    # -- the step -------------------------------------------------------------------------------------

    def train_step(self, groups: Sequence[TrajectoryGroup], config: TrainConfig, *,
                   progress: Progress | None = None, sync: StepSync | None = None) -> StepMetrics:
        """Run one GRPO optimizer step on ``groups``.

        Args:
            groups: the step's groups (with ``sync``: this rank's share of them).
            config: learning rate, loss and batching settings.
            progress: called with (micro-batches done, total) after each one.
            sync: when several ranks share the step (``training/distributed.py``): sums the sequence and
                token counts and the gradients over the ranks. Default: None (this process alone).

        Returns:
            The step's metrics. ``trained`` is 0.0 when every group was dropped (no update was made).

        Raises:
            TrajectoryError: a group or trajectory cannot be trained on; nothing was changed.
            TrainingError: the loss or gradient was not finite; the step was not applied.
        """
        t_start = time.perf_counter()
        loss_fn = build_loss(config.loss, beta=config.beta, tis_cap=config.tis_cap, **config.loss_options)
        scale = config.advantage_scale or loss_fn.default_advantage_scale

        # 1. advantages: group-relative; groups whose rewards are all equal teach nothing and are dropped
        for i, group in enumerate(groups):
            if len(group) == 0:
                raise TrajectoryError(f"group {i} is empty: every rollout of it failed or none was run "
                                      f"({len(group.exceptions)} exception(s) recorded); drop it before training")
        advantages = compute_group_advantages([g.rewards for g in groups], scale=scale)
        if advantages.dropped_groups:
            warnings.warn(ZeroVarianceGroupsWarning(
                f"{len(advantages.dropped_groups)} of {len(groups)} group(s) had equal rewards for every "
                f"trajectory and were dropped (indices {advantages.dropped_groups[:10]}); shape the reward so "
                "that rollouts of one task differ"), stacklevel=2)

        # 2. samples: token-exact from the gateway's records (re-rendered only as a flagged fallback)
        sample_groups: list[list[Sample]] = []
        for gi, (group, group_adv) in enumerate(zip(groups, advantages.advantages)):
            if group_adv is None:
                continue
            samples = []
            for trajectory, adv in zip(group.trajectories, group_adv):
                for sample in trajectory_samples(trajectory, self.tokenizer):
                    if len(sample.token_ids) > config.max_sequence_length:
                        raise TrajectoryError(
                            f"trajectory {trajectory.id!r} (group {gi}) has a sample of {len(sample.token_ids)} "
                            f"tokens, over max_sequence_length={config.max_sequence_length}; raise the limit "
                            "or shorten the rollout")
                    sample.advantage, sample.group_index = adv, gi
                    samples.append(sample)
            sample_groups.append(samples)

        metrics: StepMetrics = {
            "reward_mean": _mean([r for g in groups for r in g.rewards]),
            "reward_std": _std([r for g in groups for r in g.rewards]),
            "groups": float(len(groups)),
            "groups_used": float(len(sample_groups)),
            "groups_dropped": float(len(advantages.dropped_groups)),
            "trajectories": float(sum(len(g) for g in groups)),
            "rollout_exceptions": float(sum(len(g.exceptions) for g in groups)),
            "learning_rate": config.learning_rate,
        }
        all_samples = [s for g in sample_groups for s in g]
        num_sequences = len(all_samples)
        num_tokens = sum(s.num_trained for s in all_samples)
        if sync is not None:  # the losses divide by the whole step's counts, not this rank's
            num_sequences, num_tokens = (int(v) for v in sync.sum([num_sequences, num_tokens]))
        if not num_sequences:
            metrics.update(trained=0.0, seconds_total=time.perf_counter() - t_start)
            return metrics
        plan = plan_micro_batches(sample_groups, token_budget=config.micro_batch_tokens,
                                  share_prefix=config.share_prefix and self.share_prefix, pad_token_id=self._pad_id())
        total_batches = sum(len(pg.micro_batches) for pg in plan)
        if sync is not None and hasattr(sync, "planned"):  # FSDP ranks agree on a pass count (distributed.py)
            sync.planned(total_batches)
        t_prepared = time.perf_counter()

        # 3. loss: forward + backward per micro-batch; the micro-batch losses of a step add up to its loss
        self.model.train()
        stats = _StepStats(next(iter(self.params)).device)
        done = forward_tokens = 0
        try:
            for pg in plan:
                prefix = SharedPrefix(self.model, pg.prefix_ids, grad=True) if pg.prefix_ids else None
                ref_prefix = None
                if config.beta > 0 and pg.prefix_ids:
                    with torch.no_grad(), self.model.disable_adapter():
                        ref_prefix = SharedPrefix(self.model, pg.prefix_ids, grad=False)
                forward_tokens += len(pg.prefix_ids)
                for mb in pg.micro_batches:
                    out = micro_batch_logprobs(self.model, mb, prefix, with_entropy=True)
                    ref = None
                    if config.beta > 0:
                        with torch.no_grad(), self.model.disable_adapter():
                            ref = micro_batch_logprobs(self.model, mb, ref_prefix).logprobs
                    device = out.logprobs.device
                    mask = mb.trained.to(device)  # [B, T]
                    sampler = mb.sampler_logprobs.to(device)  # [B, T], NaN where the sampler gave none
                    result = loss_fn(LossInputs(
                        logprobs=out.logprobs, old_logprobs=out.logprobs.detach(),  # on-policy: one step per batch
                        advantages=mb.advantages.to(device), mask=mask,
                        num_sequences=num_sequences, num_tokens=num_tokens,
                        sampler_logprobs=sampler, ref_logprobs=ref))
                    result.loss.backward()  # a non-finite loss is caught at the step's sync, before the update
                    stats.add(result.loss, result.stats, out.entropy, mask, out.logprobs, sampler)
                    forward_tokens += int(mb.attention_mask.sum())  # a host tensor: no device sync
                    done += 1
                    if progress:
                        progress(done, total_batches)
                if prefix is not None:
                    prefix.backward()
            if sync is not None:  # every rank now holds the whole step's gradient
                sync.gradients(self.params)
            t_backward = time.perf_counter()

            # 4. optimizer step, with clipping, once the step's numbers are known to be finite
            optimizer = self._optimizer(config)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, config.max_grad_norm or math.inf)
            totals = stats.read(grad_norm)  # --- the step's one device sync: every running sum read at once ---
            bad = next((i for i, value in enumerate(totals["losses"]) if not math.isfinite(value)), None)
            if bad is not None:
                raise TrainingError(f"the {config.loss} loss is {totals['losses'][bad]} on micro-batch {bad + 1} "
                                    "of this step; the step was not applied (check rewards and learning rate)")
            if not math.isfinite(totals["grad_norm"]):
                raise TrainingError(f"gradient norm is {totals['grad_norm']}; the step was not applied "
                                    "(lower the learning rate, or check for NaN log-probs in the records)")
        except BaseException:
            self.model.zero_grad(set_to_none=True)  # leave no half-accumulated gradient behind
            raise
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t_end = time.perf_counter()

        # 5. metrics
        metrics.update(
            trained=1.0,
            loss=math.fsum(totals["losses"]),
            samples=float(num_sequences),
            samples_rerendered=float(sum(s.rerendered for s in all_samples)),
            trained_tokens=float(num_tokens),
            forward_tokens=float(forward_tokens),
            micro_batches=float(total_batches),
            entropy=totals["entropy"] / max(num_tokens, 1),
            ratio_mean=totals.get("ratio_sum", 0.0) / max(num_tokens, 1),
            ratio_max=totals["ratio_max"] if totals["ratio_max"] > -math.inf else 1.0,
            ratio_min=totals["ratio_min"] if totals["ratio_min"] < math.inf else 1.0,
            clip_fraction=totals.get("clipped_tokens", 0.0) / max(num_tokens, 1),
            kl=totals.get("kl_sum", 0.0) / max(num_tokens, 1),
            is_weight_mean=totals.get("is_weight_sum", 0.0) / max(num_tokens, 1),
            is_truncated_fraction=totals.get("is_truncated_tokens", 0.0) / max(num_tokens, 1),
            sampler_logprob_abs_diff=totals["sampler_diff"] / totals["sampler_tokens"] if totals["sampler_tokens"]
            else math.nan,
            sampler_logprob_max_abs_diff=totals["sampler_max"] if totals["sampler_tokens"] else math.nan,
            grad_norm=totals["grad_norm"],
            seconds_prepare=t_prepared - t_start,
            seconds_forward_backward=t_backward - t_prepared,
            seconds_optimizer=t_end - t_backward,
            seconds_total=t_end - t_start,
        )
        return metrics

    # -- state ----------------------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        """Write the adapter (PEFT format) and the optimizer state into ``directory``."""
        self.model.save_pretrained(directory)
        if self.optimizer is not None:
            torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")

    def load_optimizer_state(self, directory: Path) -> bool:
        """Restore the optimizer saved with a checkpoint, if there is one. Returns whether it was."""
        path = directory / "optimizer.pt"
        if not path.is_file():
            return False
        self._pending_optimizer_state = torch.load(path, map_location="cpu", weights_only=True)
        return True

    def _optimizer(self, config: TrainConfig) -> torch.optim.Optimizer:
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.params, lr=config.learning_rate, weight_decay=config.weight_decay)
            if self._pending_optimizer_state is not None:
                self.optimizer.load_state_dict(self._pending_optimizer_state)
                self._pending_optimizer_state = None
        for group in self.optimizer.param_groups:  # the config may change lr between steps
            group["lr"] = config.learning_rate
            group["weight_decay"] = config.weight_decay
        return self.optimizer

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _std(xs: list[float]) -> float:
    if not xs:
        return math.nan
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))
