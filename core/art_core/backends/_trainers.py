"""The trainer choices of ``LocalBackend(trainer=...)``: how the policy (base + LoRA) is loaded for training.

Each choice is a small ``TrainerChoice``: a check run when the backend is constructed (so a wrong choice
fails before any model loads) and a loader returning ``(peft_model, tokenizer)``. Both write the same PEFT
checkpoints through ``GRPOTrainer``, which vLLM and the transformers engine load unchanged.

- ``"peft"``: transformers + PEFT, on CPU (fp32) or CUDA (bf16). The default.
- ``"unsloth"``: Unsloth's ``FastLanguageModel`` (its fused kernels and gradient checkpointing), NVIDIA GPUs
  only, ``pip install 'art-core[unsloth]'``. Unsloth patches transformers when imported, so it is imported
  only here, when the user picked it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import LoraSettings
from ._tables import choose
from ..errors import CheckpointError, ConfigError

__all__ = ["TRAINERS", "TrainerChoice", "trainer_choice"]

Loader = Callable[[Path, LoraSettings, str, Path | None], tuple[Any, Any]]


@dataclass(frozen=True)
class TrainerChoice:
    """One ``trainer=`` option."""

    check: Callable[[str | None], None]
    """Raises ``ConfigError`` when this trainer cannot run on the device (``None``: auto); called at construction."""
    load: Loader
    """``(base_dir, lora, device, adapter_dir) -> (peft_model, tokenizer)``; runs in a worker thread."""
    share_prefix: bool
    """Whether its model takes a shared prompt's KV cache with gradients (``training/forward.py``)."""
    shares_with_engine: bool
    """Whether the transformers engine may decode the trained module itself (no adapter reload per step)."""


def _check_peft(device: str | None) -> None:
    if importlib.util.find_spec("peft") is None:
        raise ConfigError("trainer='peft' needs PEFT and transformers: pip install 'art-core[train]'")


def _load_peft(base_dir: Path, lora: LoraSettings, device: str, adapter_dir: Path | None) -> tuple[Any, Any]:
    from ..training.loading import load_policy

    return load_policy(base_dir, lora, device=device, adapter_dir=adapter_dir)


def _check_unsloth(device: str | None) -> None:
    import torch

    if not (torch.cuda.is_available() and torch.version.cuda):
        raise ConfigError("trainer='unsloth' needs an NVIDIA GPU (CUDA), and none is visible here: use "
                          "trainer='peft' (the default), which trains on CPU and GPU")
    if device is not None and not device.startswith("cuda"):
        raise ConfigError(f"trainer='unsloth' trains on CUDA only, but device={device!r}: pass device='cuda' "
                          "(or 'cuda:N'), or use trainer='peft'")
    if importlib.util.find_spec("unsloth") is None:
        raise ConfigError("trainer='unsloth' needs Unsloth: pip install 'art-core[unsloth]' (CUDA builds only), "
                          "or use trainer='peft'")


def _load_unsloth(base_dir: Path, lora: LoraSettings, device: str, adapter_dir: Path | None) -> tuple[Any, Any]:
    import torch
    from unsloth import FastLanguageModel  # patches transformers: imported only once the user chose Unsloth

    from ..training.loading import present_lora_targets

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=str(base_dir), dtype=torch.bfloat16, load_in_4bit=False,
        max_seq_length=8192,  # TrainConfig.max_sequence_length's default: longer samples are refused anyway
        device_map={"": device})
    model = FastLanguageModel.get_peft_model(
        model, r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
        target_modules=present_lora_targets(model, lora.target_modules),
        use_gradient_checkpointing="unsloth",  # Unsloth's offloaded checkpointing: long agent contexts fit
        random_state=0)
    if adapter_dir is not None:
        _load_adapter_weights(model, adapter_dir)
    FastLanguageModel.for_training(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _load_adapter_weights(model: Any, adapter_dir: Path) -> None:
    """Put a checkpoint's LoRA weights into a freshly wrapped model (same shape: ``LoraSettings`` is fixed)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = adapter_dir / "adapter_model.safetensors"
    try:
        result = set_peft_model_state_dict(model, load_file(path))
    except Exception as exc:
        raise CheckpointError(f"cannot load the adapter weights in {path} into the Unsloth model: {exc}") from exc
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise CheckpointError(f"the adapter in {adapter_dir} does not fit this model: {len(unexpected)} unexpected "
                              f"weights (first: {unexpected[0]}); was it trained with other LoraSettings?")


TRAINERS: dict[str, TrainerChoice] = {
    "peft": TrainerChoice(check=_check_peft, load=_load_peft, share_prefix=True, shares_with_engine=True),
    # Unsloth's fast forward is not known to take a prefix cache with gradients, and its patched module is
    # not what the transformers engine's batched decode expects: the engine loads each checkpoint instead.
    "unsloth": TrainerChoice(check=_check_unsloth, load=_load_unsloth, share_prefix=False, shares_with_engine=False),
}


def trainer_choice(name: str) -> TrainerChoice:
    """The ``TrainerChoice`` named ``name``.

    Raises:
        ConfigError: no trainer has that name (the message lists the known ones).
    """
    return choose(TRAINERS, name, "trainer")
