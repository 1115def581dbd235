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
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["LoraLinear", "fused_lora"]


class LoraLinear(torch.autograd.Function):
    """``x @ W.T + b + scaling * (x @ A.T) @ B.T`` with gradients for ``x``, ``A`` and ``B`` (W and b frozen).

    Kept for the backward pass: ``x`` (which the LoRA-A GEMM needs anyway, as PEFT's path keeps it) and the
    ``[tokens, rank]`` product ``x @ A.T``; no ``[tokens, out]`` tensor.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling):  # type: ignore[override]
        rows = x.reshape(-1, x.shape[-1])  # [N, in]
        out = torch.addmm(bias, rows, weight.t()) if bias is not None else rows @ weight.t()  # [N, out]
        down = rows @ lora_a.t()  # [N, r]
        out.addmm_(down, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(x, down, weight, lora_a, lora_b)
        ctx.scaling = scaling
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, down, weight, lora_a, lora_b = ctx.saved_tensors
        grad_rows = grad.reshape(-1, grad.shape[-1])  # [N, out]
        grad_down = grad_rows @ lora_b  # [N, r], unscaled
        grad_x = grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_rows @ weight  # [N, in]
            grad_x.addmm_(grad_down, lora_a, alpha=ctx.scaling)
            grad_x = grad_x.view(x.shape)
        if ctx.needs_input_grad[3]:
            grad_a = (grad_down.t() @ x.reshape(-1, x.shape[-1])).mul_(ctx.scaling)  # [r, in]
        if ctx.needs_input_grad[4]:
            grad_b = (grad_rows.t() @ down).mul_(ctx.scaling)  # [out, r]
        return grad_x, None, None, grad_a, grad_b, None


@contextmanager
def fused_lora(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, the model's eligible PEFT LoRA linear layers run through ``LoraLinear``."""
    try:
        from peft.tuners.lora import Linear
    except ImportError:  # without PEFT there is no LoRA layer to fuse
        yield
        return
    patched = [module for module in model.modules() if type(module) is Linear and _eligible(module)]
    for module in patched:
        module.forward = _fused_forward.__get__(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


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
    if not torch.is_grad_enabled():  # inference: the same three products, without an autograd node
        rows = x.reshape(-1, x.shape[-1])
        out = torch.addmm(base.bias, rows, base.weight.t()) if base.bias is not None else rows @ base.weight.t()
        out.addmm_(rows @ lora_a.t(), lora_b.t(), alpha=self.scaling[name])
        return out.view(*x.shape[:-1], out.shape[-1])
    return LoraLinear.apply(x, base.weight, base.bias, lora_a, lora_b, self.scaling[name])
