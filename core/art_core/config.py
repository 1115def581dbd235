"""The few knobs GRPO training needs, checked before any work starts.

Unknown keys are an error (``extra="forbid"``), and every default says why on its line.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ConfigError

__all__ = ["LoraSettings", "LossName", "TrainConfig"]

LossName = Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"]

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


class TrainConfig(_Config):
    """Settings of one GRPO step (``await model.train(groups, config=TrainConfig(...))``)."""

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
    max_sequence_length: int = Field(8192, ge=16)
    """Longer samples are refused with an error naming the trajectory, rather than trained on cut."""
