"""Getting a trained model out: a checkpoint as a plain PEFT adapter folder, or merged into its base model.

    art-core export .art/default/models/agent out/agent-lora            # the latest checkpoint's adapter
    art-core export .art/default/models/agent out/agent --merged --step 3

Both folders load as they are: the adapter with ``PeftModel.from_pretrained(base, folder)`` or vLLM's
``--lora-modules``; the merged one with ``AutoModelForCausalLM.from_pretrained(folder)`` or ``vllm serve folder``
(it holds the tokenizer and chat template too). A folder is written to a hidden sibling and renamed into
place, so an interrupted export never leaves a half-written folder under the requested name.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from ._paths import folder_problem
from .errors import CheckpointError, ConfigError

__all__ = ["export_adapter", "export_merged", "find_checkpoint"]

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
"""What a PEFT adapter folder needs; the optimizer state and our checkpoint marker stay behind."""


def find_checkpoint(source: Path, step: int | None = None) -> Path:
    """The checkpoint folder named by ``source``: a checkpoint folder itself, or a model folder and a step.

    Args:
        source: ``<root>/<project>/models/<name>`` or one of its ``checkpoints/NNNN`` folders.
        step: the checkpoint to take from a model folder; None: the latest complete one.

    Raises:
        CheckpointError: no such checkpoint (the message lists those on disk).
    """
    from .training.checkpoints import list_checkpoints

    source = Path(source)
    if (source / "adapter_config.json").is_file():
        if step is not None:
            raise ConfigError(f"{source} is a checkpoint folder already; drop step={step}, or pass its model folder")
        return source
    found = list_checkpoints(source)
    if not found:
        raise CheckpointError(f"{source} holds no complete checkpoint (expected a model folder with checkpoints/NNNN, "
                              "or a checkpoint folder with adapter_config.json)")
    if step is None:
        return found[-1].path
    for info in found:
        if info.step == step:
            return info.path
    raise CheckpointError(f"{source} has no checkpoint {step}: it has {[c.step for c in found]}")


def export_adapter(checkpoint: Path, out: Path) -> Path:
    """Copy a checkpoint's PEFT adapter (config and weights) into ``out``, a new folder.

    Raises:
        ConfigError: ``out`` exists and is not empty.
        CheckpointError: the checkpoint lacks an adapter file.
    """
    checkpoint = Path(checkpoint)
    missing = [name for name in ADAPTER_FILES if not (checkpoint / name).is_file()]
    if missing:
        raise CheckpointError(f"{checkpoint} is not a complete PEFT adapter: {missing} missing")

    def write(tmp: Path) -> None:
        for name in ADAPTER_FILES:
            shutil.copy2(checkpoint / name, tmp / name)

    return _write_folder(Path(out), write)


def export_merged(checkpoint: Path, out: Path, *, base_model: str | Path | None = None,
                  dtype: str = "float32") -> Path:
    """Merge a checkpoint's LoRA adapter into its base model and save a Hugging Face model folder in ``out``.

    Args:
        checkpoint: the checkpoint (or any PEFT adapter) folder.
        out: a new folder (or an empty one).
        base_model: a registered name or a local model folder; None: the ``base_model_name_or_path`` the
            adapter records.
        dtype: of the merged weights: ``"float32"`` (default: exact merge; the trainer's dtype on CPU),
            ``"bfloat16"`` or ``"float16"`` (half the size, for serving on GPUs).

    Returns:
        ``out``.

    Raises:
        ConfigError: ``out`` is not empty, or ``dtype`` is unknown.
        BaseModelNotFoundError: the base model cannot be found.
        CheckpointError: the adapter does not load onto the base model.
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .errors import BaseModelNotFoundError
    from .models import resolve_base_model

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ConfigError(f"unknown dtype {dtype!r}: choose one of {sorted(dtypes)}")
    checkpoint = Path(checkpoint)
    if base_model is not None:
        base_dir = resolve_base_model(base_model)
    else:
        recorded = _recorded_base(checkpoint)
        try:
            base_dir = resolve_base_model(recorded)
        except BaseModelNotFoundError as exc:  # a folder of the machine that trained it, most often
            raise BaseModelNotFoundError(
                f"the adapter in {checkpoint} records its base model as {recorded!r} (where it was trained), and "
                "that is not here: pass base_model= (art-core export --base-model) a registered name or a local "
                f"model folder. {exc}") from exc
    _check_empty(Path(out))
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtypes[dtype])
    try:
        merged = PeftModel.from_pretrained(base, checkpoint).merge_and_unload()
    except Exception as exc:
        raise CheckpointError(f"cannot load the adapter in {checkpoint} onto {base_dir}: {exc}") from exc
    tokenizer = AutoTokenizer.from_pretrained(base_dir)

    def write(tmp: Path) -> None:
        merged.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return _write_folder(Path(out), write)


def _recorded_base(checkpoint: Path) -> str:
    try:
        recorded = json.loads((checkpoint / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {checkpoint / 'adapter_config.json'}: {exc}") from exc
    if not recorded:
        raise ConfigError(f"the adapter in {checkpoint} does not record its base model: pass base_model=")
    return str(recorded)


def _check_empty(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists and is not an empty folder: pick a new path, or remove it first")
    problem = folder_problem(out)
    if problem:
        raise ConfigError(f"cannot make the folder {out}: {problem}; pick a path this process can write")


def _write_folder(out: Path, write: Callable[[Path], None]) -> Path:
    """Write a folder in a hidden sibling, then rename it to ``out``."""
    _check_empty(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
