"""A frozen linear weight as a copy to multiply by: in another dtype, in oneDNN's blocked layout, or both.

Shared by the transformers engine's decode (``engines/_packed.py``: products only) and the trainer's fused LoRA
layers (``training/fused_lora.py``: products and input gradients). oneDNN's packed layout is what
``torch.compile`` uses for CPU linears: PyTorch's default (MKL) re-packs the weight on every call.
"""

from __future__ import annotations

import torch

__all__ = ["BaseWeight"]


class BaseWeight:
    """A frozen weight ``W`` (``[out, in]``) as a copy in ``dtype``, packed into oneDNN's blocked layout or not.

    Products take and return the rows' dtype; inside, they run in ``dtype`` (outputs rounded to it). Packed, a
    second blocked copy (of ``W``'s transpose) serves the input gradient, unless ``gradients=False`` (a decode).
    """

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, packed: bool, *, gradients: bool = True) -> None:
        copy = weight.detach().to(dtype)  # the weight itself when dtype is its own
        self.dtype = dtype
        self.packed = packed
        self._forward = self._backward = copy
        if packed:
            reorder = torch.ops.mkldnn._reorder_linear_weight
            self._forward = reorder(copy, None)  # [out, in] as a linear weight: rows @ W.T
            self._backward = reorder(copy.t().contiguous(), None) if gradients else None  # [in, out]: grad @ W

    @property
    def nbytes(self) -> int:
        """Memory the copies hold (an unpacked copy in the weight's own dtype is the weight: counted anyway)."""
        tensors = {id(t): t for t in (self._forward, self._backward) if t is not None}.values()
        return sum(t.numel() * t.element_size() for t in tensors)

    def product(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``rows @ W.T + b``: ``[N, in] -> [N, out]``."""
        out = self._mm(rows, self._forward, transpose=True)
        return out.add_(bias) if bias is not None else out

    def grad_input(self, grad_rows: torch.Tensor) -> torch.Tensor:
        """``grad @ W``: ``[N, out] -> [N, in]``."""
        if self._backward is None:
            raise RuntimeError("this weight copy was made with gradients=False")
        return self._mm(grad_rows, self._backward, transpose=False)

    def _mm(self, rows: torch.Tensor, weight: torch.Tensor, *, transpose: bool) -> torch.Tensor:
        x = rows.to(self.dtype)
        if self.packed:
            out = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
        else:
            out = x @ (weight.t() if transpose else weight)
        return out.to(rows.dtype)
