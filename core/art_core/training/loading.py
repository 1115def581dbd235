"""Loading the policy a trainer trains: a base model with a trainable LoRA adapter (fresh, or a checkpoint's).

Kept apart from the trainer because everything that needs a policy loads it the same way: the local trainer
choices (``backends/_trainers.py``), a Ray trainer rank and a Ray replica serving the adapter. None of them
needs the training step to load one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..config import LoraSettings
from ..errors import CheckpointError, ConfigError

__all__ = ["load_policy", "present_lora_targets"]


def load_policy(base_dir: Path, lora: LoraSettings, *, device: str, adapter_dir: Path | None = None) -> tuple[Any, Any]:
    """Load the base model with a trainable LoRA adapter (fresh, or from ``adapter_dir``).

    Args:
        base_dir: the base model's local folder.
        lora: the adapter's shape (rank, alpha, dropout, target modules).
        device: ``"cpu"`` (float32: CPUs are slow at bf16 matmuls) or a CUDA device (bfloat16).
        adapter_dir: a checkpoint's folder (PEFT format) to resume from; None: a fresh adapter.

    Returns:
        (peft_model, tokenizer)

    Raises:
        ConfigError: none of ``lora.target_modules`` exists in the model (the message lists its linear layers).
        CheckpointError: the adapter in ``adapter_dir`` does not load onto this base model.
    """
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32  # CPUs are slow at bf16 matmuls
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).to(device)
    if adapter_dir is None:
        config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                            target_modules=present_lora_targets(base, lora.target_modules), task_type="CAUSAL_LM")
        with _seeded(lora.seed):
            model = get_peft_model(base, config)
    else:
        try:
            model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
        except Exception as exc:
            raise CheckpointError(f"cannot load the adapter in {adapter_dir} onto {base_dir}: {exc}") from exc
    return model, tokenizer


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Within the block, torch draws from ``seed`` (on the CPU and every CUDA device); the random states are put
    back after, so nothing outside the block is seeded. ``seed=None``: the block changes nothing."""
    if seed is None:
        yield
        return
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda):  # manual_seed seeds them all: restore them all
        torch.manual_seed(seed)
        yield


def present_lora_targets(model: torch.nn.Module, wanted: list[str]) -> list[str]:
    """The names of ``wanted`` that name modules of ``model`` (LoRA's ``target_modules`` it can wrap).

    Raises:
        ConfigError: none of them exists (the message lists the model's projection layers to pick from).
    """
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    present = [m for m in wanted if m in names]
    if not present:
        raise ConfigError(f"none of the LoRA target modules {wanted} exist in this model; "
                          f"its linear layers include {sorted(n for n in names if n.endswith('proj'))}")
    return present
