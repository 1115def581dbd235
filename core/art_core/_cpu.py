"""What the CPU (and this PyTorch on it) can do: native bf16 products, oneDNN's pre-packed linear weights."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

__all__ = ["cpu_has_native_bf16", "onednn_packing_available"]


@functools.cache
def cpu_has_native_bf16() -> bool | None:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16); None where that cannot be read (not
    Linux). Without it bf16 GEMMs are emulated and slower than fp32's."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return None
    return "avx512_bf16" in flags or "amx_bf16" in flags


def onednn_packing_available() -> bool:
    """Whether this PyTorch has oneDNN, turned on, and the two operators that reorder a linear weight once into its
    blocked layout and multiply by it (``torch.compile``'s own for CPU linears)."""
    ops = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled and ops is not None
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))
