"""One training step on a LoRA adapter, in five phases: advantages -> samples -> accumulate -> apply -> metrics.

``GRPOTrainer`` owns the PEFT model and its optimizer. ``train_step`` reads top to bottom as the phases of a
step; what is learned is its pluggable part, an ``Objective`` (``objectives.py``: how each trajectory is weighed
and the loss of a micro-batch), GRPO's by default. The advantages come before the samples because an objective
weighs trajectories from their rewards alone: a group it drops is never turned into token samples.

Each sample may carry the log-probs of the policy that sampled it (``Sample.behaviour_logprobs``): the loss's
importance ratio then corrects for the policy's lag exactly (off-policy data), within a clip range compounded over
the steps since sampling (``TrainConfig.off_policy_trust_region``); without them the trainer's own detached
log-probs stand in (on-policy, ratio 1 in value). With ``TrainConfig(off_policy_correction="weight")``
the ratio is always the on-policy one and the truncated importance weight against the sampler's log-probs
corrects the lag instead (the decoupled objective). Either way a stale group's advantages are re-centred on the
reward the current policy expects (``stale_baseline.py``; ``TrainConfig(off_policy_baseline="sampled")`` keeps
the sampled mean).

Supervised fine-tuning goes through the same phases (``train_step`` with an ``SFTConfig``): every trajectory
weighs 1 (``SFTObjective``), and the step is several optimizer steps, ``epochs`` passes over ``batch_size``-
trajectory batches, each accumulated and applied as a GRPO step is, at the rate of a schedule over them.

The orchestration around a step (writing trajectories before it, checkpoints and history after it) lives in
the backends. When an in-process engine decodes this very module, the step holds it (``_ownership.py``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._ownership import module_ownership
from ..config import SFTConfig, TrainConfig
from ..errors import ConfigError, TrainingError, TrajectoryError
from ..types import Trajectory, TrajectoryGroup
from .advantages import ZeroVarianceGroupsWarning  # re-exported; defined without torch (clients warn too)
from .batching import MicroBatch, PackedGroups, PrefixGroup, plan_micro_batches
from .checkpoints import MARKER
from .distributed import StepSync
from .forward import PrefixBatch, SharedPrefix, micro_batch_logprobs, plain_head
from .fused_lora import BaseCopies, base_matmuls, cpu_has_native_bf16, head_copy, make_base_copies
from .loading import load_policy  # re-exported: its home before training/loading.py
from .losses import LossInputs
from .objectives import GRPOObjective, Objective, SFTObjective, Weights
from .samples import Sample, attribute_behaviour, trajectory_samples
from .schedules import learning_rates
from .stale_baseline import StaleBaselines
from .staleness import StaleGroupsWarning, staleness
from .step_stats import StepStats, sft_metrics, step_metrics

__all__ = ["GRPOTrainer", "StaleGroupsWarning", "ZeroVarianceGroupsWarning", "check_config", "load_policy"]

StepMetrics = dict[str, float]
Progress = Callable[[int, int], None]


def check_config(config: TrainConfig | SFTConfig) -> None:
    """Check what ``TrainConfig`` cannot check by itself (the loss and its ``loss_options``), before any work.
    An ``SFTConfig`` checks itself.

    Raises:
        ConfigError: the loss refuses an option or a value (the message names it and lists the accepted ones).
    """
    if isinstance(config, TrainConfig):
        GRPOObjective.from_config(config)


@dataclass
class _Work:
    """The step's samples, planned into micro-batches, with the step-wide counts the losses divide by."""

    samples: list[Sample]
    plan: list[PrefixGroup | PackedGroups]
    num_sequences: int
    """Sequences in the whole step (summed over the ranks with a ``StepSync``)."""
    num_tokens: int
    """Trained tokens in the whole step (likewise)."""
    ratio_to_sampler: bool = True
    """Stale samples' loss ratio against their sampler (``TrainConfig.off_policy_correction="ratio"``); False: against
    the current policy, the truncated importance weight correcting them (``"weight"``)."""
    baselines: StaleBaselines | None = None
    """Stale groups' advantages re-centred on the current policy (``TrainConfig.off_policy_baseline="reweighted"``,
    ``stale_baseline.py``); None: as sampled, or no stale group in the step."""
    trust_from_step: int | None = None
    """The policy step a stale sample's clip range is compounded from (``TrainConfig.off_policy_trust_region=
    "compounded"``: ``1 + staleness`` steps); None: every clip range spans one step."""

    @property
    def micro_batches(self) -> int:
        return sum(len(pg.micro_batches) for pg in self.plan)


class GRPOTrainer:
    """Trains one LoRA adapter with GRPO (or another ``Objective`` through the same step).

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
        self._optimizer_kind: str | None = None
        """The step kind (``"grpo"``, ``"sft"``) whose gradients the optimizer's momentum holds."""
        # AdamW state read from a checkpoint (and its step's kind); applied when the optimizer is built at the
        # first step (its momentum dropped if that step is of the other kind).
        self._pending_optimizer_state: dict[str, Any] | None = None
        self._pending_optimizer_kind: str | None = None
        self._base_copies: BaseCopies = {}
        """Copies of the frozen base weights (``TrainConfig.base_matmul_dtype``, ``prepacked_base_weights``), made at
        first use."""
        self._warned_bf16 = False  # the emulated-bf16 warning is given once per trainer

    def prepare(self, config: TrainConfig | SFTConfig) -> None:
        """Make now what a first step under ``config`` would make at its start: the copies of the frozen weights
        that ``base_matmul_dtype`` and ``prepacked_base_weights`` ask for (SmolLM2-135M pre-packed in fp32: ~0.8 s
        of one core, 1 GB), so that step runs at a later one's speed. ``pipeline`` calls it (through the backend)
        while the first rollouts run, when the trainer would idle anyway. Changes no parameter; idempotent; not
        to be run beside a step of this trainer (both would make the copies)."""
        with base_matmuls(self._base_matmul_dtype(config), self._base_copies, packed=config.prepacked_base_weights):
            make_base_copies(self.model)
            head = plain_head(self.model)
            if head is not None:
                head_copy(head.weight)

    # -- the step -------------------------------------------------------------------------------------

    def train_step(self, groups: Sequence[TrajectoryGroup], config: TrainConfig | SFTConfig, *,
                   progress: Progress | None = None, sync: StepSync | None = None,
                   objective: Objective | None = None, policy_step: int | None = None,
                   shard: tuple[int, int] | None = None) -> StepMetrics:
        """Run one step on ``groups``: one GRPO optimizer step, or, with an ``SFTConfig``, a supervised
        fine-tuning pass (``_train_sft``: several optimizer steps).

        Args:
            groups: the step's groups (GRPO with ``sync``: this rank's share of them; SFT: all of them).
            config: learning rate, loss and batching settings; an ``SFTConfig`` makes it a supervised step.
            progress: called with (micro-batches done, total) after each one.
            sync: when several ranks share the step (``training/distributed.py``): sums the sequence and
                token counts and the gradients over the ranks. Default: None (this process alone).
            objective: what the step optimises. Default: ``GRPOObjective.from_config(config)``.
            policy_step: the adapter step the module is at. Samples an older adapter sampled (their records'
                ``adapter_step``) are then off-policy, and their sampler's log-probs are their behaviour log-probs
                (``samples.attribute_behaviour``); each group's staleness (``training/staleness.py``) is reported,
                and groups past ``config.max_off_policy`` are dropped before any token is read. Default: None,
                every sample counts as on-policy. Not used by SFT.
            shard: SFT with ``sync`` only: ``(rank, ranks)``; this rank trains its part of every batch (the
                ranks must run the same optimizer steps, so each gets all groups and takes a slice of each batch).

        Returns:
            The step's metrics. ``trained`` is 0.0 when every group was dropped (no update was made).

        Raises:
            TrajectoryError: a group or trajectory cannot be trained on; nothing was changed.
            ConfigError: ``config.max_off_policy`` is set but ``policy_step`` is not (staleness needs it).
            TrainingError: the loss or gradient was not finite; the step was not applied. Or an in-process
                engine decodes this module and is not paused (``_ownership.py``); nothing was changed.
        """
        base_dtype = self._base_matmul_dtype(config)
        if isinstance(config, SFTConfig):
            with base_matmuls(base_dtype, self._base_copies, packed=config.prepacked_base_weights):
                return self._train_sft(groups, config, objective or SFTObjective(), progress, sync, shard)
        t_start = time.perf_counter()
        objective = objective or GRPOObjective.from_config(config)
        # an engine sharing the module is paused until we are done
        with (module_ownership(self.model).training(),
              base_matmuls(base_dtype, self._base_copies, packed=config.prepacked_base_weights)):
            # 0. staleness: groups sampled too many steps ago are dropped before any of their tokens is read
            kept, stale_metrics = _drop_stale(groups, config, policy_step)
            # 1. advantages: the objective weighs each trajectory from the rewards (GRPO drops groups that teach nothing)
            weights = _weigh([groups[i] for i in kept], objective, indices=kept)
            # 2. samples: token-exact from the records, each with its weight, behaviour log-probs and sampling step
            sample_groups = self._samples([groups[i] for i in kept], weights, config, policy_step)
            metrics = _group_metrics(groups, weights, sample_groups, config)
            metrics.update(stale_metrics)
            work = self._plan(sample_groups, config, sync, policy_step)
            if not work.num_sequences:
                metrics.update(trained=0.0, seconds_total=time.perf_counter() - t_start)
                return metrics
            t_prepared = time.perf_counter()
            # 3. accumulate: forward + backward per micro-batch; the micro-batch losses of a step add up to its loss
            stats, forward_tokens = self._accumulate(work, objective, progress, sync)
            t_backward = time.perf_counter()
            # 4. apply: clip, check the step's numbers at its one device sync, then the optimizer step
            totals = self._apply(stats, config, objective)
            t_end = time.perf_counter()
        # 5. metrics
        metrics.update(_baseline_metrics(work.baselines))
        metrics.update(step_metrics(totals, work.samples, num_sequences=work.num_sequences,
                                    num_tokens=work.num_tokens, forward_tokens=forward_tokens,
                                    micro_batches=work.micro_batches),
                       seconds_prepare=t_prepared - t_start, seconds_forward_backward=t_backward - t_prepared,
                       seconds_optimizer=t_end - t_backward, seconds_total=t_end - t_start)
        return metrics

    def _base_matmul_dtype(self, config: TrainConfig | SFTConfig) -> torch.dtype | None:
        """``config.base_matmul_dtype`` as a torch dtype; warns (once per trainer) where bf16 is emulated."""
        if config.base_matmul_dtype is None:
            return None
        dtype = getattr(torch, config.base_matmul_dtype)
        if (not self._warned_bf16 and dtype == torch.bfloat16 and self.params[0].device.type == "cpu"
                and cpu_has_native_bf16() is False):
            self._warned_bf16 = True
            warnings.warn("base_matmul_dtype='bfloat16' on a CPU without native bf16 (no AVX512-BF16 or AMX-BF16 "
                          "in /proc/cpuinfo): its bf16 matmuls are emulated and slower than float32's; leave "
                          "base_matmul_dtype unset on this machine", stacklevel=3)
        return dtype

    def _samples(self, groups: Sequence[TrajectoryGroup], weights: Weights, config: TrainConfig,
                 policy_step: int | None) -> list[list[Sample]]:
        """The samples of every kept group (one list per kept group), each carrying its trajectory's weight, and
        its behaviour log-probs when it is older than ``policy_step``."""
        sample_groups: list[list[Sample]] = []
        for gi, (group, group_weights) in enumerate(zip(groups, weights.per_group)):
            if group_weights is None:
                continue
            samples = []
            for trajectory, weight in zip(group.trajectories, group_weights):
                for sample in trajectory_samples(trajectory, self.tokenizer):
                    _check_length(sample, trajectory, f"group {gi}", config)
                    sample.advantage, sample.group_index = weight, gi
                    samples.append(sample)
            if policy_step is not None:
                attribute_behaviour(samples, policy_step)
            sample_groups.append(samples)
        return sample_groups

    def _plan(self, sample_groups: list[list[Sample]], config: TrainConfig | SFTConfig,
              sync: StepSync | None, policy_step: int | None = None) -> _Work:
        """Count the step's sequences and tokens (over every rank) and plan its micro-batches."""
        samples = [s for g in sample_groups for s in g]
        num_sequences, num_tokens = len(samples), sum(s.num_trained for s in samples)
        if sync is not None:  # the losses divide by the whole step's counts, not this rank's
            num_sequences, num_tokens = (int(v) for v in sync.sum([num_sequences, num_tokens]))
        if not num_sequences:
            return _Work(samples, [], 0, 0)
        share = config.share_prefix and self.share_prefix
        pack = share and isinstance(config, TrainConfig) and config.pack_groups  # an SFT batch is one group
        plan = plan_micro_batches(sample_groups, token_budget=config.micro_batch_tokens, share_prefix=share,
                                  pad_token_id=self._pad_id(), pack_groups=pack)
        ratio_to_sampler = not isinstance(config, TrainConfig) or config.off_policy_correction == "ratio"
        baselines = None
        if isinstance(config, TrainConfig) and config.off_policy_baseline == "reweighted":
            # an FSDP rank (a sync that plans passes) may add no forward pass: the others would not join it
            baselines = StaleBaselines(samples, plan, extra_pass=not hasattr(sync, "planned")) or None
        compounded = (ratio_to_sampler and isinstance(config, TrainConfig)
                      and config.off_policy_trust_region == "compounded")
        return _Work(samples, plan, num_sequences, num_tokens, ratio_to_sampler, baselines,
                     policy_step if compounded else None)

    def _accumulate(self, work: _Work, objective: Objective, progress: Progress | None,
                    sync: StepSync | None) -> tuple[StepStats, int]:
        """Forward and backward over every micro-batch, gradients summed in place. Returns the running sums and
        the tokens run through the model. On failure no half-accumulated gradient is left behind."""
        if sync is not None and hasattr(sync, "planned"):  # FSDP ranks agree on a pass count (distributed.py)
            sync.planned(work.micro_batches)  # here, not at planning: an SFT pass plans all its steps first
        self.model.train()
        stats = StepStats(next(iter(self.params)).device)
        done = forward_tokens = 0
        root = ref_root = None  # the prompt every group starts with, run once for the step (batching.py)
        try:
            if work.baselines is not None and work.baselines.split:
                forward_tokens += self._stale_log_weights(work, work.baselines)
            for pg in work.plan:
                prompts = _prompts(pg)
                if pg.root_length and root is None:
                    root = SharedPrefix(self.model, prompts[0][:pg.root_length], grad=True)
                    if objective.reference:
                        with torch.no_grad(), self.model.disable_adapter():
                            ref_root = SharedPrefix(self.model, root.ids, grad=False)
                    forward_tokens += root.length
                parent, ref_parent = (root, ref_root) if pg.root_length else (None, None)
                prefix = self._prefix(pg, grad=True, parent=parent)
                ref_prefix = None
                if objective.reference and prompts:
                    with torch.no_grad(), self.model.disable_adapter():
                        ref_prefix = self._prefix(pg, grad=False, parent=ref_parent)
                forward_tokens += sum(len(prompt) - pg.root_length for prompt in prompts)
                for mb in pg.micro_batches:
                    self._micro_batch(mb, prefix, ref_prefix, objective, work, stats)
                    forward_tokens += int(mb.attention_mask.sum())  # a host tensor: no device sync
                    done += 1
                    if progress:
                        progress(done, work.micro_batches)
                if prefix is not None:
                    prefix.backward()  # into the LoRA weights, and the root's leaves
            if root is not None:
                root.backward()
            if sync is not None:  # every rank now holds the whole step's gradient
                sync.gradients(self.params)
        except BaseException:
            self.model.zero_grad(set_to_none=True)
            raise
        return stats, forward_tokens

    @torch.no_grad()
    def _stale_log_weights(self, work: _Work, baselines: StaleBaselines) -> int:
        """A forward pass without gradient over the micro-batches holding samples of stale groups spread over
        several micro-batches (over the token budget): their trajectories' importance log-weights,
        which re-centring needs before any of their losses (``stale_baseline.py``). Returns the tokens run."""
        root, tokens = None, 0
        for pg in work.plan:
            wanted = [mb for mb in pg.micro_batches if any(s.group_index in baselines.split for s in mb.samples)]
            if not wanted:
                continue
            prompts = _prompts(pg)
            if pg.root_length and root is None:
                root = SharedPrefix(self.model, prompts[0][:pg.root_length], grad=False)
                tokens += root.length
            prefix = self._prefix(pg, grad=False, parent=root if pg.root_length else None)
            tokens += sum(len(prompt) - pg.root_length for prompt in prompts)
            for mb in wanted:
                baselines.add_log_weights(mb, micro_batch_logprobs(self.model, mb, prefix).logprobs)
                tokens += int(mb.attention_mask.sum())
        return tokens

    def _prefix(self, pg: PrefixGroup | PackedGroups, *, grad: bool,
                parent: SharedPrefix | None) -> SharedPrefix | PrefixBatch | None:
        """The prompt(s) ``pg``'s micro-batches continue: one group's, or packed groups' as one batch."""
        if isinstance(pg, PackedGroups):
            return PrefixBatch(self.model, pg.prefixes, grad=grad, parent=parent, pad_token_id=self._pad_id())
        return SharedPrefix(self.model, pg.prefix_ids, grad=grad, parent=parent) if pg.prefix_ids else None

    def _micro_batch(self, mb: MicroBatch, prefix: SharedPrefix | PrefixBatch | None,
                     ref_prefix: SharedPrefix | PrefixBatch | None,
                     objective: Objective, work: _Work, stats: StepStats) -> None:
        """One micro-batch's forward, loss and backward; its numbers are added to ``stats``."""
        out = micro_batch_logprobs(self.model, mb, prefix, with_entropy=True)
        ref = None
        if objective.reference:
            with torch.no_grad(), self.model.disable_adapter():
                ref = micro_batch_logprobs(self.model, mb, ref_prefix).logprobs
        device = out.logprobs.device
        mask = mb.trained.to(device)  # [B, T]
        sampler = mb.sampler_logprobs.to(device)  # [B, T], NaN where the sampler gave none
        advantages = (mb.advantages.to(device) if work.baselines is None
                      else work.baselines.advantages(mb, out.logprobs.detach()))
        result = objective(LossInputs(
            logprobs=out.logprobs, old_logprobs=_old_logprobs(mb, out.logprobs, work.ratio_to_sampler),
            advantages=advantages, mask=mask,
            num_sequences=work.num_sequences, num_tokens=work.num_tokens,
            sampler_logprobs=sampler, ref_logprobs=ref, trust_steps=_trust_steps(mb, work.trust_from_step, device)))
        result.loss.backward()  # a non-finite loss is caught at the step's sync, before the update
        stats.add(result.loss, result.stats, out.entropy, mask, out.logprobs, sampler)

    def _apply(self, stats: StepStats, config: TrainConfig | SFTConfig, objective: Objective,
               learning_rate: float | None = None) -> dict[str, Any]:
        """Clip the gradient and take the optimizer step (at ``learning_rate``, default the config's), once the
        step's numbers are known to be finite.

        Returns:
            ``StepStats.read``'s totals.

        Raises:
            TrainingError: the loss or the gradient norm is not finite; the step was not applied.
        """
        try:
            optimizer = self._optimizer(config, config.learning_rate if learning_rate is None else learning_rate)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, config.max_grad_norm or math.inf)
            totals = stats.read(grad_norm)  # --- the step's one device sync: every running sum read at once ---
            bad = next((i for i, value in enumerate(totals["losses"]) if not math.isfinite(value)), None)
            if bad is not None:
                raise TrainingError(f"the {objective.name} loss is {totals['losses'][bad]} on micro-batch {bad + 1} "
                                    "of this step; the step was not applied (check rewards and learning rate)")
            if not math.isfinite(totals["grad_norm"]):
                raise TrainingError(f"gradient norm is {totals['grad_norm']}; the step was not applied "
                                    "(lower the learning rate, or check for NaN log-probs in the records)")
        except BaseException:
            self.model.zero_grad(set_to_none=True)  # leave no half-accumulated gradient behind
            raise
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return totals

    # -- supervised fine-tuning: the same phases, several optimizer steps ----------------------------------

    def _train_sft(self, groups: Sequence[TrajectoryGroup], config: SFTConfig, objective: Objective,
                   progress: Progress | None, sync: StepSync | None, shard: tuple[int, int] | None) -> StepMetrics:
        """``config.epochs`` passes over the groups' trajectories (in order), one optimizer step per
        ``config.batch_size`` of them, the learning rate following ``config.lr_schedule`` over those steps."""
        t_start = time.perf_counter()
        with module_ownership(self.model).training(), self._restored_on_failure():
            # 1. weights: every trajectory counts, once (SFT reads no reward and drops nothing)
            _weigh(groups, objective)
            trajectories = [t for g in groups for t in g.trajectories]
            batches = [trajectories[i:i + config.batch_size] for i in range(0, len(trajectories), config.batch_size)]
            if shard is not None:  # this rank's part of each batch: every rank takes every optimizer step
                rank, ranks = shard
                batches = [batch[rank::ranks] for batch in batches]
            # 2. samples: token-exact from the records, re-rendered otherwise; planned once, reused every epoch
            works = [self._plan([self._sft_samples(batch, config)], config, sync) for batch in batches]
            rates = learning_rates(config.learning_rate, config.epochs * len(works), schedule=config.lr_schedule,
                                   warmup_ratio=config.warmup_ratio)
            total = config.epochs * sum(work.micro_batches for work in works)
            t_prepared = time.perf_counter()
            # 3-4. each optimizer step: accumulate its micro-batches, then apply at the schedule's rate
            step_totals: list[dict[str, Any]] = []
            forward_tokens = done = 0
            for s, work in enumerate(works * config.epochs):
                report = _offset(progress, done, total)
                stats, tokens = self._accumulate(work, objective, report, sync)
                step_totals.append(self._apply(stats, config, objective, learning_rate=rates[s]))
                forward_tokens += tokens
                done += work.micro_batches
            t_end = time.perf_counter()
        # 5. metrics
        metrics = _sft_group_metrics(groups)
        metrics.update(sft_metrics(step_totals, [s for w in works for s in w.samples], rates=rates,
                                   epochs=config.epochs, num_sequences=sum(w.num_sequences for w in works),
                                   num_tokens=sum(w.num_tokens for w in works), forward_tokens=forward_tokens,
                                   micro_batches=total),
                       seconds_prepare=t_prepared - t_start, seconds_forward_backward=t_end - t_prepared,
                       seconds_total=t_end - t_start)
        return metrics

    @contextlib.contextmanager
    def _restored_on_failure(self) -> Iterator[None]:
        """Put the adapter and the optimizer back as they were if the block raises.

        An SFT pass takes many optimizer steps; one failing (a non-finite loss, an interrupt) after others were
        applied would leave weights that no checkpoint holds, and an engine decoding this module would serve
        them. Restoring keeps the rule of a GRPO step: a step that fails changes nothing. The copy is of the
        LoRA parameters and AdamW's state only (small next to the base).
        """
        params = [p.detach().clone() for p in self.params]
        optimizer = copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None
        pending = self._pending_optimizer_state, self._pending_optimizer_kind
        kind = self._optimizer_kind
        try:
            yield
        except BaseException:
            with torch.no_grad():
                for param, saved in zip(self.params, params, strict=True):
                    param.copy_(saved)
            if optimizer is None:  # no optimizer before the pass: build it afresh (from a checkpoint's state) next time
                self.optimizer = None
                self._pending_optimizer_state, self._pending_optimizer_kind = pending
            else:  # the pass may have dropped the momentum (another step kind): the old moments go back in
                assert self.optimizer is not None
                self.optimizer.load_state_dict(optimizer)
                self._optimizer_kind = kind
            self.model.zero_grad(set_to_none=True)
            raise

    def _sft_samples(self, trajectories: Sequence[Trajectory], config: SFTConfig) -> list[Sample]:
        """The samples of one batch: only the assistant turns ``config.assistant_turns`` names are trained."""
        samples = []
        for trajectory in trajectories:
            for sample in trajectory_samples(trajectory, self.tokenizer, assistant_turns=config.assistant_turns):
                _check_length(sample, trajectory, "SFT data", config)
                sample.advantage = 1.0
                samples.append(sample)
        return samples

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
        self._pending_optimizer_kind = _checkpoint_kind(directory)
        return True

    def _optimizer(self, config: TrainConfig | SFTConfig, learning_rate: float) -> torch.optim.Optimizer:
        # The momentum (a direction) belongs to the objective that built it: at a step of the other kind it is
        # dropped. Carried from SFT into GRPO it steered the GRPO steps: tic_tac_toe's 6 GRPO steps after SFT each
        # moved the adapter at cosine 0.8-0.96 to the SFT optimizer's last update. The second moments (each
        # parameter's gradient scale) and the step count stay: with a fresh AdamW, bias correction makes the first
        # step move every parameter by the full rate, and one GRPO step at 2e-3 took langgraph_tools from 70% to
        # 45% held-out after its warm start; kept, the new momentum builds up over ~10 steps, a warm-up.
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.params, lr=learning_rate, weight_decay=config.weight_decay)
            if self._pending_optimizer_state is not None:
                self.optimizer.load_state_dict(self._pending_optimizer_state)
                self._optimizer_kind = self._pending_optimizer_kind
            self._pending_optimizer_state = self._pending_optimizer_kind = None
        if self._optimizer_kind not in (None, config.kind):
            for state in self.optimizer.state.values():
                if "exp_avg" in state:
                    state["exp_avg"].zero_()
        self._optimizer_kind = config.kind
        for group in self.optimizer.param_groups:  # the config (or the SFT schedule) changes lr between steps
            group["lr"] = learning_rate
            group["weight_decay"] = config.weight_decay
        return self.optimizer

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))



def _checkpoint_kind(directory: Path) -> str:
    """The step kind that wrote the checkpoint in ``directory`` (its ``checkpoint.json``; older ones: GRPO)."""
    try:
        kind = json.loads((directory / MARKER).read_text()).get("kind", "grpo")
    except (OSError, ValueError):
        return "grpo"
    return str(kind)


def _check_length(sample: Sample, trajectory: Trajectory, where: str, config: TrainConfig | SFTConfig) -> None:
    if len(sample.token_ids) > config.max_sequence_length:
        raise TrajectoryError(
            f"trajectory {trajectory.id!r} ({where}) has a sample of {len(sample.token_ids)} tokens, over "
            f"max_sequence_length={config.max_sequence_length}; raise the limit or shorten the rollout")


def _offset(progress: Progress | None, before: int, total: int) -> Progress | None:
    """``progress`` for one optimizer step of several: its micro-batches counted after the ``before`` done."""
    if progress is None:
        return None
    return lambda done, _step_total: progress(before + done, total)


def _sft_group_metrics(groups: Sequence[TrajectoryGroup]) -> StepMetrics:
    """What an SFT step reports of its data (rewards are not trained on; they are logged as GRPO's are)."""
    rewards = [r for g in groups for r in g.rewards]
    return {"reward_mean": _mean(rewards), "reward_std": _std(rewards), "groups": float(len(groups)),
            "groups_used": float(len(groups)), "groups_dropped": 0.0,
            "trajectories": float(sum(len(g) for g in groups)),
            "rollout_exceptions": float(sum(len(g.exceptions) for g in groups))}


def _drop_stale(groups: Sequence[TrajectoryGroup], config: TrainConfig,
                policy_step: int | None) -> tuple[list[int], StepMetrics]:
    """The indices of the groups within ``config.max_off_policy`` of ``policy_step`` (all of them without a bound),
    and the staleness metrics (none without ``policy_step``); warns about the dropped groups.

    Raises:
        ConfigError: a bound is set but ``policy_step`` is not.
    """
    if policy_step is None:
        if config.max_off_policy is not None:
            raise ConfigError(f"TrainConfig(max_off_policy={config.max_off_policy}) needs train_step(policy_step=...), "
                              "the checkpoint the module is at (the backends pass it): staleness is measured from it")
        return list(range(len(groups))), {}
    found = staleness(groups, policy_step, config.max_off_policy)
    if found.stale:
        warnings.warn(StaleGroupsWarning(found.message()), stacklevel=3)  # the caller of train_step
    dropped = set(found.stale)
    return [i for i in range(len(groups)) if i not in dropped], found.metrics()


def _weigh(groups: Sequence[TrajectoryGroup], objective: Objective, indices: Sequence[int] | None = None) -> Weights:
    """The objective's weights for ``groups``, after checking none is empty; warns about dropped groups (named by
    ``indices[i]``, their places in the caller's list, when given)."""
    for i, group in enumerate(groups):
        if len(group) == 0:
            raise TrajectoryError(f"group {indices[i] if indices is not None else i} is empty: every rollout of it "
                                  "failed or none was run "
                                  f"({len(group.exceptions)} exception(s) recorded); drop it before training")
    weights = objective.weigh(groups)
    if weights.dropped:
        named = [indices[i] for i in weights.dropped] if indices is not None else weights.dropped
        warnings.warn(ZeroVarianceGroupsWarning(
            f"{len(weights.dropped)} of {len(groups)} group(s) had equal rewards for every "
            f"trajectory and were dropped (indices {named[:10]}); shape the reward so "
            "that rollouts of one task differ"), stacklevel=3)  # the caller of train_step
    return weights


def _group_metrics(groups: Sequence[TrajectoryGroup], weights: Weights, sample_groups: list[list[Sample]],
                   config: TrainConfig) -> StepMetrics:
    """The metrics known before any forward pass: rewards, groups kept and dropped, the learning rate."""
    rewards = [r for g in groups for r in g.rewards]
    return {
        "reward_mean": _mean(rewards),
        "reward_std": _std(rewards),
        "groups": float(len(groups)),
        "groups_used": float(len(sample_groups)),
        "groups_dropped": float(len(weights.dropped)),
        "trajectories": float(sum(len(g) for g in groups)),
        "rollout_exceptions": float(sum(len(g.exceptions) for g in groups)),
        "learning_rate": config.learning_rate,
    }


def _prompts(pg: PrefixGroup | PackedGroups) -> list[list[int]]:
    """The prompts ``pg``'s micro-batches continue (none when its samples share nothing)."""
    return pg.prefixes if isinstance(pg, PackedGroups) else [pg.prefix_ids] if pg.prefix_ids else []


def _baseline_metrics(baselines: StaleBaselines | None) -> dict[str, float]:
    """``groups_recentred`` (stale groups whose advantages were re-centred) and ``stale_baseline_mean`` (their mean
    shift ``b``, in advantage units: above 0 when the adapter already favours the better answers it was trained
    on). Read after the step's sync."""
    shifts = torch.stack(baselines.shifts).tolist() if baselines is not None and baselines.shifts else []
    return {"groups_recentred": float(len(shifts)), "stale_baseline_mean": _mean(shifts) if shifts else 0.0}


def _old_logprobs(mb: MicroBatch, logprobs: torch.Tensor, ratio_to_sampler: bool) -> torch.Tensor:
    """``[B, T]`` the loss's ``old_logprobs``: those of the policy the samples are attributed to.

    On-policy (no sample gave any), or with ``ratio_to_sampler`` False (``off_policy_correction="weight"``: the
    truncated importance weight corrects stale samples instead): the current ones, detached, so the ratio is 1 in
    value and its gradient is that of log pi. Otherwise each sample's own, with the current ones where it gave
    none (NaN).
    """
    current = logprobs.detach()
    if mb.behaviour_logprobs is None or not ratio_to_sampler:
        return current
    given = mb.behaviour_logprobs.to(current.device)  # [B, T], NaN where not given
    return torch.where(torch.isnan(given), current, given.to(current.dtype))


def _trust_steps(mb: MicroBatch, policy_step: int | None, device: torch.device) -> torch.Tensor | None:
    """``[B]`` the steps each row's clip range spans: 1 + the staleness of a sample trained against its sampler
    (``TrainConfig.off_policy_trust_region="compounded"``), 1 for the others. None when every row spans one."""
    if policy_step is None or mb.behaviour_logprobs is None:
        return None
    steps = [1 + max(0, policy_step - s.sampling_step)
             if s.behaviour_logprobs is not None and s.sampling_step is not None else 1 for s in mb.samples]
    return torch.tensor(steps, dtype=torch.float32, device=device)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _std(xs: list[float]) -> float:
    if not xs:
        return math.nan
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))
