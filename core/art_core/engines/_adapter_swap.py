"""Serving the next checkpoint of a LoRA adapter by copying its weights into the adapter being served.

PEFT's ``load_adapter`` builds a second set of LoRA modules, loads into them, and the engine then deletes the old
set: ~0.24 s per checkpoint for SmolLM2-135M (r=8 on every linear layer, one core), spent while the engine is
paused. A training run's checkpoints all have the served adapter's shape, so their tensors can be copied into the
served adapter's instead. ``load_into_active_adapter`` does that when it is safe (same LoRA settings, same tensor
names and shapes) and otherwise changes nothing and returns False, for the caller's general path.

The copy goes straight into the tensors PEFT's ``get_peft_model_state_dict`` names (views of the parameters),
not through ``set_peft_model_state_dict``, whose ``load_state_dict`` walks the whole model for 420 small tensors:
50 ms of CPU a checkpoint instead of 90 ms on one core (``tests/benchmarks/adapter_swap.py``). A copy bumps each
tensor's version counter, which is how the engine's packed weight copies see the change (``engines/_packed.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["load_into_active_adapter"]

# The settings that decide a LoRA adapter's tensors and how they are applied (``scaling`` = alpha / r, or
# alpha / sqrt(r) with rsLoRA, per module with the patterns). Two adapters equal on all of them differ only in
# their weights.
_APPLIED_SETTINGS = ("peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "use_dora",
                     "bias", "fan_in_fan_out", "modules_to_save", "layers_to_transform", "layers_pattern")


def load_into_active_adapter(model: Any, path: Path) -> bool:
    """Copy the adapter in ``path`` into ``model``'s active adapter if it has the same settings and tensors.

    Args:
        model: a ``PeftModel`` serving one adapter.
        path: a PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``).

    Returns:
        True when the active adapter now holds ``path``'s weights; False when ``path`` differs in its settings,
        tensor names or shapes, or is not saved as safetensors (the model is then unchanged).
    """
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = path / "adapter_model.safetensors"
    active = model.active_adapter
    if not weights.is_file() or not isinstance(active, str) or active not in model.peft_config:
        return False
    served = model.peft_config[active].to_dict()
    incoming = json.loads((path / "adapter_config.json").read_text())
    if any(_normalised(served.get(key)) != _normalised(incoming.get(key)) for key in _APPLIED_SETTINGS):
        return False
    state = load_file(weights)  # its tensor names say which modules it adapts: they must be the served ones'
    current = get_peft_model_state_dict(model, adapter_name=active)
    if state.keys() != current.keys() or any(state[k].shape != current[k].shape for k in state):
        return False
    if _views_of_parameters(model, current.values()):
        with torch.no_grad():
            for name, tensor in state.items():
                current[name].copy_(tensor)  # casts to the served dtype, as load_state_dict would
    else:  # a tensor PEFT built rather than viewed (none for LoRA today): its own loader knows where it goes
        set_peft_model_state_dict(model, state, adapter_name=active)
    return True


def _views_of_parameters(model: Any, tensors: Any) -> bool:
    """Whether every tensor is one of ``model``'s parameters seen through ``detach`` (same memory, same shape and
    strides), so that a copy into it changes the model."""
    parameters = {(p.data_ptr(), p.shape, p.stride()) for p in model.parameters()}
    return all((t.data_ptr(), t.shape, t.stride()) in parameters for t in tensors)


def _normalised(value: Any) -> Any:
    """Settings as JSON has them: enums as their values, sets and tuples as sorted lists."""
    if isinstance(value, (set, frozenset, tuple, list)):
        return sorted(_normalised(v) for v in value)
    if hasattr(value, "value"):  # PeftType and other enums
        return value.value
    return value
