"""The training forward's memory savings: patches that change what is kept for the backward pass, never a value.

``training/forward.py`` computes log-probabilities; this module makes that forward hold less while it does. Each
saving is scoped to a ``with`` block (instance ``forward``s and ``config._attn_implementation`` are set for the
block and restored after; no class is patched), and each gives the same values and gradients, bit for bit on
CPU, as plain autograd (tests/training/test_forward.py):

- ``native_gqa_attention``: grouped-query K/V are not repeated per query group before SDPA;
- ``lean_mlp``: a SwiGLU MLP keeps ``gate`` and ``up`` only (``SwiGLU``), and down_proj's input is recomputed;
- behind a shared prefix (``lean_forward(model, prefix_length)``), attention keeps the prefix's keys and values
  once, not once per row (``_PrefixAttention``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SwiGLU", "lean_forward", "lean_mlp", "native_gqa_attention"]


_GQA_SDPA = "art_sdpa_native_gqa"


@contextmanager
def native_gqa_attention(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, a model using transformers' ``"sdpa"`` attention keeps grouped-query K/V un-repeated.

    transformers' SDPA path copies each layer's keys and values once per query group (``repeat_kv``) whenever
    an attention mask is given, which a training forward always has (padding, or a shared prefix's cache).
    Those copies are kept for the backward pass: for SmolLM2 (3 K/V heads, 9 query heads) they are a fifth
    of a micro-batch's activation memory. ``scaled_dot_product_attention(enable_gqa=True)`` reads the groups
    in place: the same result (bit for bit on CPU; tests/training/test_forward.py), less memory and time.

    The attention function is registered once, under its own name, in transformers' attention tables
    (additive: no existing entry changes); the model's ``_attn_implementation`` is switched to it for the
    block and restored after. Any other implementation (eager, flash, ...) is left alone.
    """
    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None)
    if previous != "sdpa":
        yield
        return
    _register_native_gqa()
    config._attn_implementation = _GQA_SDPA
    try:
        yield
    finally:
        config._attn_implementation = previous


def _register_native_gqa() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if _GQA_SDPA not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(_GQA_SDPA, _sdpa_native_gqa)
        ALL_MASK_ATTENTION_FUNCTIONS.register(_GQA_SDPA, sdpa_mask)  # the masks "sdpa" gets


def _sdpa_native_gqa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, with grouped K/V heads passed to the kernel as they are (``enable_gqa``)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_length = query.shape[2]
    plain = all(kwargs.get(name) is None for name in ("softcap", "position_bias", "cache")) \
        and not kwargs.get("output_attentions", False)
    if getattr(module, "num_key_value_groups", 1) <= 1 or q_length == 1 or not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = attention_mask is None and is_causal
    if is_causal and key.shape[2] > q_length:  # as transformers does: causal without a mask means no cache
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    block = _PREFIX_BLOCK.get()
    if (block is not None and not is_causal and dropout == 0.0 and attention_mask is not None
            and query.device.type == "cpu" and torch.is_grad_enabled() and key.shape[0] > 1
            and key.shape[2] > block.length and _shares_prefix(key, value, block.length)):
        out = _PrefixAttention.apply(query, key, value, _float_mask(block, attention_mask, query.dtype),
                                     scaling if scaling is not None else query.shape[-1] ** -0.5, block.length)
        return out.transpose(1, 2).contiguous(), None
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
        enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


@dataclass
class _PrefixBlock:
    """A micro-batch's forward behind a shared prefix of ``length`` tokens, and its masks converted once."""

    length: int
    masks: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]]


# Set while a micro-batch runs behind a shared prefix: that block's attention keeps one copy of the prefix's keys
# and values for the backward pass, not one per row (``_PrefixAttention``).
_PREFIX_BLOCK: ContextVar[_PrefixBlock | None] = ContextVar("art_shared_prefix_block", default=None)


@contextmanager
def lean_forward(model: torch.nn.Module, prefix_length: int = 0) -> Iterator[None]:
    """The training forward's memory savings, for one block: native GQA, ``lean_mlp``, and, behind a shared prefix
    of ``prefix_length`` tokens (0: none), one copy of its keys and values kept for the backward pass."""
    token = _PREFIX_BLOCK.set(_PrefixBlock(prefix_length, {}) if prefix_length else None)
    try:
        with native_gqa_attention(model), lean_mlp(model):
            yield
    finally:
        _PREFIX_BLOCK.reset(token)


def _shares_prefix(key: torch.Tensor, value: torch.Tensor, length: int) -> bool:
    """Whether every row's first ``length`` keys and values are row 0's (a prefix cache expanded to the batch)."""
    return all(torch.equal(t[1:, :, :length], t[:1, :, :length].expand(t.shape[0] - 1, -1, -1, -1))
               for t in (key, value))


def _float_mask(block: _PrefixBlock, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` as SDPA turns a boolean one into an additive one (0 / -inf), converted once for all layers.

    Every layer gets the same mask object; SDPA would convert (and keep for the backward pass) one copy per layer.
    """
    if mask.dtype != torch.bool:
        return mask
    hit = block.masks.get(dtype)
    if hit is None or hit[0] is not mask:
        converted = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        hit = block.masks[dtype] = (mask, converted.masked_fill_(mask.logical_not(), float("-inf")))
    return hit[1]


class _PrefixAttention(torch.autograd.Function):
    """SDPA over keys and values whose first ``length`` positions are the same in every row (a shared prefix).

    The values and gradients are those of ``scaled_dot_product_attention`` on CPU (the same flash kernels,
    forward and backward); what differs is what is kept for the backward pass: the prefix's keys and values
    once, not once per row, plus each row's own suffix. The full tensors are rebuilt for the backward kernel
    (a copy, no recomputed attention). For SmolLM2 behind a 256-token prompt, 8 rows: -100 MiB per step.
    """

    @staticmethod
    def forward(ctx, query, key, value, mask, scale, length):  # type: ignore[override]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, False, attn_mask=mask, scale=scale)
        ctx.save_for_backward(query, key[:1, :, :length].clone(), key[:, :, length:].clone(),
                              value[:1, :, :length].clone(), value[:, :, length:].clone(), out, lse, mask)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        query, key_prefix, key_rest, value_prefix, value_rest, out, lse, mask = ctx.saved_tensors
        rows = key_rest.shape[0]
        key = torch.cat([key_prefix.expand(rows, -1, -1, -1), key_rest], dim=2)
        value = torch.cat([value_prefix.expand(rows, -1, -1, -1), value_rest], dim=2)
        grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, lse, 0.0, False, attn_mask=mask, scale=ctx.scale)
        return grad_q, grad_k, grad_v, None, None, None


class SwiGLU(torch.autograd.Function):
    """``silu(gate) * up``, keeping only ``gate`` and ``up`` for the backward pass.

    Autograd on the two ops also keeps ``silu(gate)``, a third ``[tokens, intermediate]`` tensor per layer;
    here it is recomputed in the backward pass (one elementwise op). Values and gradients are the same ops
    as autograd's (``silu``, ``mul``, ``silu_backward``), so the same bits.
    """

    @staticmethod
    def forward(ctx, gate, up):  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * torch.nn.functional.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


# Gated MLPs whose forward is exactly ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with a SiLU act_fn.
_SWIGLU_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})


@contextmanager
def lean_mlp(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, the model's SwiGLU MLPs run through ``SwiGLU`` (one activation fewer kept per layer).

    Only MLP classes known to compute ``down_proj(silu(gate_proj(x)) * up_proj(x))`` are touched; each gets an
    instance ``forward`` for the block, removed after (the class is never patched). Other models are left alone.
    """
    patched = []
    for module in model.modules():
        if (type(module).__name__ in _SWIGLU_MLPS and "forward" not in vars(module) and _is_silu(module)
                and type(module).forward.__module__.startswith("transformers.")):  # not one patched by e.g. Unsloth
            module.forward = _swiglu_forward.__get__(module)
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def _is_silu(module: torch.nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    if isinstance(act, torch.nn.SiLU):
        return True
    return type(act).__name__ == "SiLUActivation" and type(act).forward.__module__.startswith("transformers.")


def _swiglu_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    hidden = SwiGLU.apply(gate, up)
    if not torch.is_grad_enabled() or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return self.down_proj(hidden)  # someone else's saved-tensor hooks (checkpointing, offloading) stay in charge
    # down_proj's LoRA keeps its input for the backward pass; SwiGLU already keeps gate and up, from which that
    # input is recomputed bit for bit (same ops, same operands), so it is not kept a second time.
    storage = hidden.untyped_storage().data_ptr()

    def pack(t: torch.Tensor) -> Any:
        if t.untyped_storage().data_ptr() == storage and t.dtype == hidden.dtype:
            return (gate, up, t.shape, t.stride(), t.storage_offset())
        return t

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        g, u, shape, stride, offset = packed
        return (torch.nn.functional.silu(g) * u).as_strided(shape, stride, offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return self.down_proj(hidden)
