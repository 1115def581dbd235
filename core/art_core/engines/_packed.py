"""The decode loop's linear layers through oneDNN, with each weight reordered once into oneDNN's own layout.

Why: a decode step multiplies a few rows (one token per sequence) by every weight of the model, and on CPU
in float32 those products are ~75% of the step. PyTorch sends them to MKL's ``sgemm``, which re-packs the
weight on every call and is slow for few-row products on the development machine (AMD EPYC, AVX-512). oneDNN
with the weight reordered once into its blocked layout is not (SmolLM2-135M, 2 threads, one decode step; the
figures come from interleaved runs of one step; ``gateway_throughput.py --packed`` measures the whole path):

    8 rows:  MKL 84 ms, oneDNN plain weights 60 ms, oneDNN pre-packed weights 46 ms
    1 row:   MKL 67 ms, oneDNN pre-packed 52 ms

The price is memory: a second copy of every packed weight (the size of the model's linear layers, e.g.
0.54 GB for SmolLM2-135M in float32), kept while the engine lives.

Scope: only while the engine decodes (``PackedLinears.active``, entered and left by the decode thread), each
CPU float32 ``nn.Linear`` of the model gets a ``forward`` of its own (an instance attribute, removed on exit),
so the trainer, which shares the model in ``LocalBackend`` but never runs while the engine decodes (checked:
``art_core/_ownership.py``), and anyone else calling the model meanwhile, see plain ``nn.Linear``. A call that
needs gradients falls back to ``F.linear``. PEFT's LoRA layers call their base layer as a module, so the base
weight is packed. The adapter's own matrices (PEFT's ``lora_A`` and ``lora_B``) are not: products that thin (r
rows or columns) gain nothing from a packed layout, and every training step or checkpoint changes all of them, so
each would be re-packed at every step (420 of them for r=8 on every layer of SmolLM2-135M). Measured side by side
(``tests/benchmarks/adapter_swap.py``, one thread): the demo's step load decodes in 2.73 s with them plain against
3.11 s packed, and a checkpoint costs no re-packing.

Staleness: a packed copy is used only while its weight has the storage and the autograd version counter it
was packed from. Every change made the usual ways bumps the counter or swaps the storage: an optimizer step,
``load_state_dict``, ``copy_`` or ``+=`` under ``no_grad``, assigning ``weight.data``. So LoRA training on the
shared model re-packs nothing (the adapter's matrices are not packed), and the base weights (0.4 s to pack for
SmolLM2-135M) stay packed across training steps. An in-place edit through ``weight.data`` (``weight.data +=
delta``, as PEFT's ``merge_adapter`` does) bypasses the counter: code that edits served weights that way must
call ``TransformersEngine.weights_changed()``. ``load_adapter`` needs no such call: it copies into the adapter's tensors
(a version bump) or adds modules of its own, so the base's packed copies stay valid across a checkpoint swap.

Results: oneDNN sums in a different order than MKL, so a log-prob moves by rounding. On the tiny test model
that is ~1e-6; on SmolLM2-135M (8 seeded rows x 64 tokens) up to 3.5e-5, and 2 rows of 8 sampled a different
token at some point (seeds 0-7; none for seeds 100-107), about what today's engine already shows between a
row decoded alone and in a batch of 8 (2.3e-5). That is past the 1e-5 "same tokens as before" promise, so it is
off by default: ``TransformersEngine(packed_weights=True)`` turns it on; ``tests/engines/test_packed_linears.py``
checks tokens and log-probs on the tiny model.

bfloat16 (``PackedLinears(torch.bfloat16)``, ``packed_weights="bfloat16"``): each copy is packed from the weight
cast to bf16 and the rows are cast to bf16 on the way in (oneDNN accumulates in fp32 and rounds the output to bf16,
cast back to the model's dtype), but the output embedding's, which stays fp32 so that the logits, and the
log-probs the engine records, keep fp32 precision. The sampling policy is then the bf16 model's (its log-probs
differ from the fp32 model's by ~1e-2 on SmolLM2-135M); the engine records that policy's own log-probs, which is
what the trainer's importance weights take as the behaviour policy. Half the fp32 copies' memory; on a CPU with
native bf16 the GEMMs run about twice as fast (a decode step ~1.06x: attention and sampling are unchanged).

The two operators are the ones ``torch.compile`` (Inductor) uses for the same purpose on CPU; where they
are missing (a PyTorch built without oneDNN) or oneDNN is turned off (``torch.backends.mkldnn.enabled``),
nothing is packed and the model runs as it is.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.nn.functional as F

from .._cpu import cpu_has_native_bf16
from .._cpu import onednn_packing_available as packing_available  # the name its callers import
from .._weight_copy import BaseWeight

__all__ = ["PackedLinears", "PackedWeights", "packed_linears", "packing_available"]

PackedWeights = bool | Literal["float32", "bfloat16"]
"""``TransformersEngine(packed_weights=...)``: False (not packed), True or ``"float32"``, or ``"bfloat16"``."""


def packed_linears(setting: PackedWeights) -> PackedLinears | None:
    """The ``PackedLinears`` a ``packed_weights`` setting asks for (None: not packed).

    Raises:
        ValueError: not one of False, True, ``"float32"``, ``"bfloat16"``.
    """
    if setting is False:
        return None
    if setting is True or setting == "float32":
        return PackedLinears(torch.float32)
    if setting == "bfloat16":
        if cpu_has_native_bf16() is False:
            warnings.warn("packed_weights='bfloat16' on a CPU without native bf16 (no AVX512-BF16 or AMX-BF16 in "
                          "/proc/cpuinfo): its bf16 matmuls are emulated and slower than float32's; use "
                          "packed_weights=True on this machine", stacklevel=3)
        return PackedLinears(torch.bfloat16)
    raise ValueError(f"packed_weights={setting!r}: give False, True (or 'float32'), or 'bfloat16'")


def _packable(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module) is torch.nn.Linear and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.layout == torch.strided
            # A forward of its own already (accelerate's offloading hooks, a user's wrapper): left alone.
            and "forward" not in module.__dict__)


def _adapter_matrices(model: torch.nn.Module) -> set[torch.nn.Module]:
    """PEFT LoRA's own matrices: each adapted layer's ``lora_A`` and ``lora_B`` modules (left unpacked)."""
    found: set[torch.nn.Module] = set()
    for module in model.modules():
        for name in ("lora_A", "lora_B"):
            matrices = getattr(module, name, None)
            if isinstance(matrices, torch.nn.ModuleDict):
                found.update(matrices.values())
    return found


def _fingerprint(weight: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    """What must be unchanged for a packed copy to be used: storage, autograd version, shape."""
    return weight.data_ptr(), weight._version, tuple(weight.shape)


class PackedLinears:
    """oneDNN-packed copies of a model's linear weights, and the scope in which the model uses them.

    Blocking calls (packing reorders the weight): run them on the decode thread, never on the event loop.

    Args:
        dtype: the packed copies' dtype (see ``dtype`` below).
        pack_adapter: pack LoRA's own matrices too (default False: see the module's docstring; True is kept to
            measure the difference side by side).
    """

    def __init__(self, dtype: torch.dtype = torch.float32, *, pack_adapter: bool = False) -> None:
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"PackedLinears packs weights in float32 or bfloat16, not {dtype}")
        self.dtype = dtype
        """The packed copies' dtype: float32, or bfloat16 (every linear layer but the output embedding: see the
        module's docstring)."""
        self.pack_adapter = pack_adapter
        # module -> (what its weight and the dtype were when packed, the packed copy)
        self._packed: dict[torch.nn.Linear, tuple[Any, BaseWeight]] = {}
        self.packs = 0
        """Weights packed so far (re-packing after a change counts again)."""

    def __len__(self) -> int:
        return len(self._packed)

    @property
    def nbytes(self) -> int:
        """Memory the packed weight copies hold."""
        return sum(copy.nbytes for _, copy in self._packed.values())

    def clear(self) -> None:
        """Drop every packed copy (the weights may have changed behind the version counter)."""
        self._packed.clear()

    @contextlib.contextmanager
    def active(self, model: torch.nn.Module) -> Iterator[None]:
        """Within this block, the model's CPU float32 linear layers run through their packed weights.

        Copies are made on first use and re-made when a weight changed; those of layers the model no longer
        has (a deleted adapter) are dropped here.
        """
        if not packing_available():
            yield
            return
        adapter = set() if self.pack_adapter else _adapter_matrices(model)
        linears = [m for m in model.modules() if _packable(m) and m not in adapter]
        present = set(linears)
        for gone in [m for m in self._packed if m not in present]:
            del self._packed[gone]
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        for module in linears:
            dtype = torch.float32 if module is head else self.dtype
            module.forward = self._forward_of(module, dtype)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for module in linears:
                module.__dict__.pop("forward", None)

    def _forward_of(self, module: torch.nn.Linear, dtype: torch.dtype) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            weight = module.weight
            if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad) or x.dtype != weight.dtype:
                return F.linear(x, weight, module.bias)  # the packed operator has no backward
            shape = x.shape
            out = self._weight(module, weight, dtype).product(x.reshape(-1, shape[-1]), module.bias)
            return out.reshape(*shape[:-1], out.shape[-1])  # [..., in] -> [..., out]

        return forward

    def _weight(self, module: torch.nn.Linear, weight: torch.Tensor, dtype: torch.dtype) -> BaseWeight:
        """The module's packed copy, made again if its weight changed."""
        fingerprint = (_fingerprint(weight), dtype)
        entry = self._packed.get(module)
        if entry is None or entry[0] != fingerprint:
            # No batch-size hint: the same copy serves every row count (1 row decoding to a long prefill).
            entry = (fingerprint, BaseWeight(weight, dtype, packed=True, gradients=False))
            self._packed[module] = entry
            self.packs += 1
        return entry[1]
