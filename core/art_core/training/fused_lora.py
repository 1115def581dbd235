"""LoRA linear layers computed as two GEMMs and an accumulate, for the training forward.

PEFT computes a LoRA layer as ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: besides the GEMMs, that is
a scaling pass and an addition pass over the ``[tokens, out]`` output in the forward pass, a scaling pass over
its gradient in the backward pass, and an addition of the two input gradients (base and LoRA). For a small
model those memory-bound passes are a visible share of a step (SmolLM2-135M on CPU: fusing them saves 5-10% of
a training step and ~300 MiB of its peak memory, the ``[tokens, out]`` temporaries). ``LoraLinear`` folds the
scaling and the additions into the GEMMs' accumulate (``addmm_``): the same function and gradients, to float
rounding (tests/training/test_fused_lora.py).

``fused_lora(model)`` switches the eligible layers to it for a block (a per-instance ``forward``, removed after;
the class is never patched). Eligible: PEFT's plain ``lora.Linear`` with one active adapter, no dropout, no
DoRA or other variant, no LoRA bias, not merged, over a frozen ``nn.Linear``. Every other layer, and every call
with extra arguments, keeps PEFT's own forward.

``base_matmuls(dtype, copies)`` makes the fused layers multiply by their frozen base weights in a lower precision
within a block (``TrainConfig.base_matmul_dtype``): the base GEMMs, forward and backward, run on a ``dtype`` copy
of each weight (made once, kept in ``copies``) and a ``dtype`` cast of the activations, their outputs rounded to
``dtype`` and brought back to the model's dtype; the LoRA GEMMs, the LoRA gradients and everything outside these
layers keep the model's dtype. On CPUs with native bf16 GEMMs (AVX512-BF16, AMX) those run at about twice fp32's
rate (SmolLM2-135M's shapes, one core: 210 against 100 GFLOP/s, casts included). With ``packed=True``
(``TrainConfig.prepacked_base_weights``, CPU only) the copies are reordered once into oneDNN's blocked layout, one
for the forward product and one (of the transpose) for the input gradient, and the products run through oneDNN:
PyTorch's default (MKL) re-packs the weight on every call. SmolLM2-135M's shapes at one core, fp32, 96-288 rows:
8-30% faster GEMMs. The frozen LM head takes the same copies in such a block (``head_copy``, used by
``forward.ChunkedTokenLogprobs``), always in its own dtype; a demo-sized GRPO step is then 1.76x faster
(``tests/benchmarks/prepacked_base.py``), for two copies of the base's linear weights and of the head in memory
(fp32: 1.0 GB for SmolLM2-135M).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from .._cpu import cpu_has_native_bf16, onednn_packing_available
from .._weight_copy import BaseWeight

__all__ = ["BaseCopies", "BaseWeight", "LoraLinear", "base_matmuls", "cpu_has_native_bf16", "fused_lora", "head_copy",
           "make_base_copies"]


BaseCopies = dict[int, tuple["weakref.ref[torch.Tensor]", int, BaseWeight]]
"""Copies of frozen weights: ``id(weight) -> (weakref to it, its version when copied, the copy)``."""

# (dtype or None, packed, copies) while a ``base_matmuls`` block runs in this thread; read by the fused layers.
_BASE_MATMULS: ContextVar[tuple[torch.dtype | None, bool, BaseCopies] | None] = ContextVar("art_base_matmuls",
                                                                                          default=None)


class LoraLinear(torch.autograd.Function):
    """``x @ W.T + b + scaling * (x @ A.T) @ B.T`` with gradients for ``x``, ``A`` and ``B`` (W and b frozen).

    Kept for the backward pass: ``x`` (which the LoRA-A GEMM needs anyway, as PEFT's path keeps it) and the
    ``[tokens, rank]`` product ``x @ A.T``; no ``[tokens, out]`` tensor. ``base`` (optional): a ``BaseWeight``
    copy of ``W`` to multiply by instead, both ways (``base_matmuls``).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling, base=None):  # type: ignore[override]
        rows = x.reshape(-1, x.shape[-1])  # [N, in]
        out = _base_product(rows, weight, bias, base)  # [N, out]
        down = _rank_product(rows, lora_a)  # [N, r]
        out.addmm_(down, lora_b.t(), alpha=scaling)
        # With a copy, the graph holds the copy only (the weight itself may be dropped while a graph is alive).
        ctx.save_for_backward(x, down, weight if base is None else None, lora_a, lora_b)
        ctx.base = base
        ctx.scaling = scaling
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, down, weight, lora_a, lora_b = ctx.saved_tensors
        grad_rows = grad.reshape(-1, grad.shape[-1])  # [N, out]
        grad_down = _rank_product(grad_rows, lora_b.t())  # [N, r], unscaled
        grad_x = grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_rows @ weight if ctx.base is None else ctx.base.grad_input(grad_rows)  # [N, in]
            grad_x.addmm_(grad_down, lora_a, alpha=ctx.scaling)
            grad_x = grad_x.view(x.shape)
        if ctx.needs_input_grad[3]:
            grad_a = (grad_down.t() @ x.reshape(-1, x.shape[-1])).mul_(ctx.scaling)  # [r, in]
        if ctx.needs_input_grad[4]:
            grad_b = _factor_gradient(grad_rows, down).mul_(ctx.scaling)  # [out, r]
        return grad_x, None, None, grad_a, grad_b, None, None


def _rank_product(rows: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``rows @ factor.T`` (``[N, k] x [r, k] -> [N, r]``, r the LoRA rank), computed as ``(factor @ rows.T).T``.

    Why: MKL's GEMM is slow at producing a few columns of many rows; the transposed problem (a few rows of many
    columns) gives the same products, to float rounding, 1.7-4x faster at LoRA's shapes (SmolLM2-135M, r=8, 256
    rows, one core: the forward's ``x @ A.T`` 69 -> 41 us, the backward's ``grad @ B`` 169 -> 41 us; likewise
    ``B``'s gradient, taken as ``(down.T @ grad).T``: ``_factor_gradient``). The result is a transposed view, which
    ``addmm_`` and ``@`` take as it is. ``tests/benchmarks/lora_products.py`` times a step against the plain forms.
    """
    return (factor @ rows.t()).t()


def _factor_gradient(grad_rows: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``grad_rows.T @ down`` (``[N, out], [N, r] -> [out, r]``), LoRA B's gradient, as ``(down.T @ grad_rows).T``
    (see ``_rank_product``)."""
    return (down.t() @ grad_rows).t()


def _base_product(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  base: BaseWeight | None) -> torch.Tensor:
    """``rows @ W.T + b`` in the rows' dtype, the product taken on ``base`` (W's copy) if given."""
    if base is None:
        return torch.addmm(bias, rows, weight.t()) if bias is not None else rows @ weight.t()
    return base.product(rows, bias)


@contextmanager
def base_matmuls(dtype: torch.dtype | None, copies: BaseCopies, *, packed: bool = False) -> Iterator[None]:
    """Within the block (in this thread), fused LoRA layers multiply by copies of their frozen base weights.

    Args:
        dtype: the matmuls' dtype, e.g. ``torch.bfloat16``; None: the weights' own.
        copies: where each weight's copy is kept between blocks (its owner's lifetime: the trainer's). A copy is
            remade when its weight was changed in place (a merge), and dropped with the weight.
        packed: the copies in oneDNN's blocked layout, their products through oneDNN (CPU weights only, where this
            PyTorch has oneDNN turned on; elsewhere this changes nothing).

    With neither ``dtype`` (other than the weights' own) nor ``packed``, the block changes nothing.
    """
    token = _BASE_MATMULS.set((dtype, packed, copies) if dtype is not None or packed else None)
    try:
        yield
    finally:
        _BASE_MATMULS.reset(token)


def head_copy(weight: torch.Tensor) -> BaseWeight | None:
    """The frozen LM head's packed copy for a ``base_matmuls(packed=True)`` block (its products, forward and input
    gradient, through oneDNN), or None (no such block, or no oneDNN). Always in the head's own dtype, whatever the
    block's: its logits are the log-probs the loss and the importance ratios read, which bf16 rounding would move.

    Why: at SmolLM2's head (49k x 576) and a chunk of 171 rows, MKL runs ``h @ W.T`` in 107 ms and ``p @ W`` in 97 ms
    on one core, oneDNN's packed copies in 55 and 43 ms (allocation included); the head is ~20% of a demo step.
    """
    return _base_copy(weight, own_dtype=True)


def _base_copy(weight: torch.Tensor, *, own_dtype: bool = False) -> BaseWeight | None:
    """``weight``'s copy for the ``base_matmuls`` block, or None outside such a block (or where it asks nothing
    of this weight: its own dtype, not packed). ``own_dtype``: packed in the weight's dtype, not the block's."""
    setting = _BASE_MATMULS.get()
    if setting is None:
        return None
    dtype, packed, copies = setting
    dtype = weight.dtype if own_dtype or dtype is None else dtype
    packed = packed and weight.device.type == "cpu" and onednn_packing_available()
    if dtype == weight.dtype and not packed:
        return None
    # Made once and kept: a cast reads every base weight (~0.06 s for SmolLM2-135M on one core), and a step runs
    # several forwards. Keyed by id with a weakref check, since tensors compare elementwise (no dict keys).
    entry = copies.get(id(weight))
    if (entry is None or entry[0]() is not weight or entry[1] != weight._version
            or (entry[2].dtype, entry[2].packed) != (dtype, packed)):
        key = id(weight)
        entry = (weakref.ref(weight, lambda _, key=key: copies.pop(key, None)), weight._version,
                 BaseWeight(weight, dtype, packed))
        copies[key] = entry
    return entry[2]


def make_base_copies(model: torch.nn.Module) -> None:
    """Make, inside a ``base_matmuls`` block, the copies its fused layers would make at their first product: of
    every eligible LoRA layer's base weight (``TrainConfig`` asks for them; ``GRPOTrainer.prepare`` calls this so
    that the first step does not pay for them). Outside a block, or where the block asks nothing, nothing."""
    for module in _fusable_layers(model):
        _base_copy(module.base_layer.weight)


@contextmanager
def fused_lora(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, the model's eligible PEFT LoRA linear layers run through ``LoraLinear``."""
    patched = _fusable_layers(model)
    for module in patched:
        module.forward = _fused_forward.__get__(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def _fusable_layers(model: torch.nn.Module) -> list[Any]:
    """The model's PEFT LoRA linear layers that ``LoraLinear`` can compute (``_eligible``)."""
    try:
        from peft.tuners.lora import Linear
    except ImportError:  # without PEFT there is no LoRA layer to fuse
        return []
    return [module for module in model.modules() if type(module) is Linear and _eligible(module)]


def _eligible(module: Any) -> bool:
    if "forward" in vars(module) or not type(module).forward.__module__.startswith("peft."):
        return False  # a forward someone else replaced (Unsloth, ...)
    base = module.base_layer
    adapters = [a for a in module.active_adapters if a in module.lora_A]
    if (module.merged or module.disable_adapters or len(adapters) != 1 or type(base) is not torch.nn.Linear
            or base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad)):
        return False
    (name,) = adapters
    return (type(module.lora_dropout[name]) is torch.nn.Identity and not module.use_dora.get(name, False)
            and name not in getattr(module, "lora_variant", {}) and module.lora_B[name].bias is None
            and type(module.lora_A[name]) is torch.nn.Linear and type(module.lora_B[name]) is torch.nn.Linear)


def _fused_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    (name,) = [a for a in self.active_adapters if a in self.lora_A]
    base, lora_a, lora_b = self.base_layer, self.lora_A[name].weight, self.lora_B[name].weight
    if (args or kwargs or self.disable_adapters or self.merged or x.dtype != base.weight.dtype
            or lora_a.dtype != x.dtype):  # anything PEFT's forward handles and this one does not
        return type(self).forward(self, x, *args, **kwargs)
    low = _base_copy(base.weight)
    if not torch.is_grad_enabled():  # inference: the same three products, without an autograd node
        rows = x.reshape(-1, x.shape[-1])
        out = _base_product(rows, base.weight, base.bias, low)
        out.addmm_(_rank_product(rows, lora_a), lora_b.t(), alpha=self.scaling[name])
        return out.view(*x.shape[:-1], out.shape[-1])
    return LoraLinear.apply(x, base.weight, base.bias, lora_a, lora_b, self.scaling[name], low)
