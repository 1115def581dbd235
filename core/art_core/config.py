"""The few knobs a training step needs (GRPO's ``TrainConfig``, supervised fine-tuning's ``SFTConfig``), checked
before any work starts.

Unknown keys are an error (``extra="forbid"``), and every default says why on its line.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError, model_validator

from .errors import ConfigError

__all__ = ["STEP_KINDS", "LoraSettings", "LossName", "OffPolicyBaseline", "OffPolicyCorrection",
           "OffPolicyTrustRegion", "SFTConfig", "StepConfig", "TrainConfig", "step_config"]

LossName = Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"]
OffPolicyCorrection = Literal["ratio", "weight"]
OffPolicyBaseline = Literal["reweighted", "sampled"]
OffPolicyTrustRegion = Literal["compounded", "fixed"]

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CheckedSettings(BaseModel):
    """Settings whose invalid values raise ``ConfigError`` (every problem listed), not pydantic's error.

    Subclasses name themselves in that message with ``settings_name`` (e.g. ``"VLLMOptions"``).
    """

    settings_name: ClassVar[str] = "settings"

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(f"invalid {type(self).settings_name} ({exc.error_count()} problem(s)):\n{exc}") from exc


class LoraSettings(_Config):
    """The LoRA adapter that is trained. Fixed for a model's life: checkpoints must match it."""

    rank: int = Field(8, ge=1)
    """8: RL moves few bits per step, and LoRA matches full fine-tuning for RL even at low ranks
    ("LoRA Without Regret", Thinking Machines, 2025)."""
    alpha: int = Field(16, ge=1)
    """Usually 2 x rank."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """0: dropout would make the trainer's log-probs disagree with the sampler's."""
    target_modules: list[str] = Field(default_factory=lambda: list(ALL_LINEAR))
    """All linear layers, attention and MLP: adapting the MLP matters most (same paper)."""
    seed: int | None = None
    """Seeds a fresh adapter's initial weights (LoRA's A matrices; B starts at zero), so that a run can be repeated
    exactly; None: drawn from torch's global random state. Not used when a checkpoint is resumed."""


class TrainConfig(_Config):
    """Settings of one GRPO step (``await model.train(groups, config=TrainConfig(...))``)."""

    kind: Literal["grpo"] = "grpo"
    """Names the step's kind on the wire and in ``history.jsonl`` (``SFTConfig`` says ``"sft"``)."""

    learning_rate: float = Field(5e-5, gt=0)
    """5e-5: LoRA wants about 10x the learning rate of full fine-tuning (1e-6..1e-5 for RL)."""
    loss: LossName = "dapo"
    """dapo: token-level normalisation (no length bias across a batch) and clip-higher (keeps exploring)."""
    loss_options: dict[str, float | int | None] = Field(default_factory=dict)
    """Passed to the loss class, e.g. ``{"epsilon_high": 0.28}``; see ``art_core.training.losses``."""
    advantage_scale: Literal["group", "batch", "none"] | None = None
    """Divide centred rewards by the group's std, the batch's std, or nothing; None = the loss's choice."""
    beta: float = Field(0.0, ge=0.0)
    """KL weight to the base model. 0: DAPO and Dr. GRPO drop it, and it costs a forward pass of the base."""
    tis_cap: float | None = Field(2.0, gt=0)
    """Cap of the truncated importance weight trainer/sampler (Yao et al. 2025); None turns it off."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Gradient clipping: keeps one lucky group from moving the adapter far."""
    weight_decay: float = Field(0.0, ge=0.0)
    """0: the adapter starts at zero change; decay would pull it back for no gain in RL."""
    micro_batch_tokens: int = Field(4096, ge=16)
    """Most padded tokens in one forward pass: bounds memory whatever the group size."""
    share_prefix: bool = True
    """Run each group's common prompt once (exact). False only to compare."""
    pack_groups: bool = True
    """Pack a step's small groups: their prompts as one batch, their completions in shared micro-batches (exact,
    faster on CPU: larger matrix products). False only to compare."""
    max_sequence_length: int = Field(8192, ge=16)
    """Longer samples are refused with an error naming the trajectory, rather than trained on cut."""
    base_matmul_dtype: Literal["bfloat16"] | None = None
    """None: the frozen base weights multiply in the model's own dtype (float32 on CPU, bfloat16 on CUDA).
    ``"bfloat16"``: in the LoRA-adapted layers the base weights' matmuls (forward and backward) run on a bfloat16
    copy of them, kept for the trainer's life (half the fp32 base weights' memory), their outputs rounded to
    bfloat16; the LoRA weights and gradients, norms, attention, the LM head and the loss keep the model's dtype.
    On CPUs with native bf16 (AVX512-BF16, AMX) those matmuls run ~2x faster; the trainer's log-probs then
    differ from an fp32 sampler's by bf16 rounding, which the importance ratio sees (as on GPUs, where trainer
    and sampler round differently)."""
    prepacked_base_weights: bool = False
    """CPU only (ignored elsewhere). True: in the LoRA-adapted layers the frozen base weights' matmuls (forward and
    input gradient), and the frozen LM head's, run through oneDNN on copies reordered once into its blocked layout
    (PyTorch's default, MKL, re-packs the weight on every call): a demo-sized GRPO step 1.76x faster in fp32 on the
    development CPU (1.08-1.57x before the head was packed too), for two copies of the base's linear weights and of
    the head kept for the trainer's life (1.0 GB for SmolLM2-135M in fp32; with ``base_matmul_dtype="bfloat16"``
    the linear weights' copies are bf16, half theirs, while the head's stay in its own dtype: its logits are the
    log-probs). Results move by float rounding (another summation order). False: PyTorch's matmuls on the weights
    themselves."""
    off_policy_correction: OffPolicyCorrection = "ratio"
    """How a stale sample (drawn by an adapter older than the one training) is corrected; both take the sampler's
    recorded log-probs as the behaviour policy's. ``"ratio"``: the loss's ratio is ``pi / pi_sampler``, so its
    clipping keeps the update within the trust region around the policy that sampled it (PPO's reading; a
    stale token the adapter has already moved past the clip range gets no gradient). ``"weight"``: the decoupled
    objective (AReaL, Fu et al. 2025): the ratio is taken against the current policy (1 in value: a step is one
    optimizer step), as for fresh samples, and the staleness is corrected by the truncated importance weight
    ``min(pi / pi_sampler, tis_cap)`` in front of each token's loss; every stale token keeps a gradient. Needs
    ``tis_cap``."""
    off_policy_trust_region: OffPolicyTrustRegion = "compounded"
    """Under ``off_policy_correction="ratio"``, how far a stale sample's ratio ``pi / pi_sampler`` may go before
    the clip removes a token's gradient. ``"compounded"``: the loss's one-step range compounded over the sample's
    staleness ``s`` and the step itself, ``[(1 - eps_low)^(s+1), (1 + eps_high)^(s+1)]`` (DAPO's defaults: 0.64 to
    1.64 for ``s = 1``). The ``s`` steps since sampling each moved the adapter within a trust region of their own;
    a token they moved keeps its gradient until this step would take it past one more. ``"fixed"``: the one-step
    range whatever the staleness, so a token the steps since sampling moved past it gets no gradient (it is most
    often a token being learned: on the demo's task this trains measurably less per step; README, "Asynchronous
    training"). Fresh samples (``s = 0``) train the same either way; ``"weight"`` has no such range."""
    off_policy_baseline: OffPolicyBaseline = "reweighted"
    """What a stale group's advantages are centred on (``training/stale_baseline.py``). ``"reweighted"``: the
    reward the *current* adapter expects on the group's task, estimated from the group's own answers by
    self-normalised importance weights ``pi(y) / pi_sampler(y)`` (each trajectory's log-probs under the training
    adapter against the sampler's recorded ones). A group whose better answers the adapter already favours then
    has its advantages lowered by that much, so the step does not push again where the steps since its sampling
    already pushed (fresh data would show that push; stale data cannot). ``"sampled"``: the group's mean as
    sampled. Fresh groups train the same either way; metrics ``groups_recentred``, ``stale_baseline_mean``."""
    max_off_policy: int | None = Field(None, ge=0)
    """Most steps the adapter may have moved since a group was sampled (its staleness, ``training/staleness.py``:
    0 for the synchronous loop, where each step trains on groups the checkpoint before it sampled). Staler groups
    are dropped before any token is read, counted in ``groups_stale`` and warned about. None: no bound (stale
    samples are still corrected exactly from the sampler's recorded log-probs: ``off_policy_correction``)."""

    @model_validator(mode="after")
    def _weight_correction_has_a_cap(self) -> TrainConfig:
        if self.off_policy_correction == "weight" and self.tis_cap is None:
            raise ValueError('off_policy_correction="weight" corrects stale samples by the truncated importance '
                             'weight, which tis_cap=None turns off: give tis_cap (default 2.0) or use "ratio"')
        return self


class SFTConfig(_Config):
    """Settings of one supervised fine-tuning step (``await model.train_sft(data, config=SFTConfig(...))``).

    One SFT step is one call: ``epochs`` passes over the data in ``batch_size``-trajectory optimizer steps, the
    learning rate following ``lr_schedule`` over those steps, then one checkpoint. The loss is the negative
    log-likelihood of the assistant's tokens, averaged over the tokens of each optimizer step.
    """

    kind: Literal["sft"] = "sft"
    """Names the step's kind on the wire and in ``history.jsonl``."""
    learning_rate: float = Field(1e-4, gt=0)
    """1e-4: the usual LoRA SFT rate (about 10x full fine-tuning's); the peak, before the schedule."""
    epochs: int = Field(1, ge=1)
    """Passes over the data. 1: more overfits small demonstration sets quickly."""
    batch_size: int = Field(8, ge=1)
    """Trajectories per optimizer step (their tokens are averaged together). The last batch may be smaller."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "linear"
    """linear: decay to zero over the call's optimizer steps (transformers' default), after the warmup."""
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    """Share of the call's optimizer steps spent ramping the rate up from near zero. 0: a LoRA starts at no change."""
    assistant_turns: Literal["all", "last"] = "all"
    """Which assistant turns are trained: every one, or only each trajectory's last (its final call)."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Gradient clipping per optimizer step; None turns it off."""
    weight_decay: float = Field(0.0, ge=0.0)
    """0: as for GRPO, decay would pull the adapter back toward the base for no gain."""
    micro_batch_tokens: int = Field(4096, ge=16)
    """Most padded tokens in one forward pass: bounds memory whatever ``batch_size`` is."""
    share_prefix: bool = True
    """Run a batch's common prompt (system prompt, tool schemas) once, its cache reused (exact). False to compare."""
    max_sequence_length: int = Field(8192, ge=16)
    """Longer samples are refused with an error naming the trajectory, rather than trained on cut."""
    base_matmul_dtype: Literal["bfloat16"] | None = None
    """As ``TrainConfig.base_matmul_dtype``: ``"bfloat16"`` runs the frozen base weights' matmuls on a bfloat16
    copy (~2x faster on CPUs with native bf16), None in the model's own dtype."""
    prepacked_base_weights: bool = False
    """As ``TrainConfig.prepacked_base_weights``: the frozen base weights' and LM head's matmuls through oneDNN on
    pre-packed copies (CPU only; faster, two copies of the base's linear weights and of the head in memory)."""


STEP_KINDS = ("grpo", "sft")
"""The ``kind`` of each step config: ``TrainConfig``'s, ``SFTConfig``'s."""

StepConfig: TypeAlias = Annotated[
    Annotated[TrainConfig, Tag("grpo")] | Annotated[SFTConfig, Tag("sft")],
    Discriminator(lambda v: (v.get("kind", "grpo") if isinstance(v, dict) else getattr(v, "kind", "grpo"))),
]
"""A step's settings as they cross the wire: ``kind`` picks the class (a body without one is GRPO's)."""

_STEP_CONFIG: TypeAdapter[TrainConfig | SFTConfig] = TypeAdapter(StepConfig)


def step_config(data: Any) -> TrainConfig | SFTConfig:
    """A step's settings from plain data (``model_dump``'s dict): ``TrainConfig`` or ``SFTConfig`` by ``kind``."""
    return _STEP_CONFIG.validate_python(data)
