"""What the benchmarks against TRL share: one LoRA initialisation for both sides, the machine's busy CPU time, the
model folder, and running one side in a process of its own.

A module of its own beside the scripts (each runs as ``python tests/benchmarks/<name>.py``, so this folder is on
``sys.path``, for the script and for the side processes it starts).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def reset_adapter(model: Any, seed: int = 0) -> str:
    """Give the LoRA weights the same values on both sides; returns a fingerprint of their names.

    Same scheme as PEFT's default init (A ~ kaiming-uniform(a=sqrt(5)) = U(+-1/sqrt(fan_in)), B = 0), drawn from
    one seeded generator in name order, because the sides consume the global RNG differently before PEFT
    initialises the adapter. With B = 0 the adapted model is the base model whatever A is, so an engine holding a
    copy of its own needs no reset.

    Raises:
        RuntimeError: a trainable parameter that is not a LoRA weight.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    names = []
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if not param.requires_grad:
                continue
            names.append(f"{name}:{tuple(param.shape)}")
            if "lora_A" in name:
                bound = 1.0 / math.sqrt(param.shape[1])
                param.copy_(torch.rand(param.shape, generator=generator) * 2 * bound - bound)
            elif "lora_B" in name:
                param.zero_()
            else:
                raise RuntimeError(f"unexpected trainable parameter {name}: only LoRA weights should train")
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:12]


def busy_cpu_seconds() -> float:
    """CPU time every process on the machine has used (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def resolve_model(name_or_path: str) -> Path:
    """A local model folder, or the folder of a base model ``art_core.models`` knows by name."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path.absolute()
    from art_core.models import resolve_base_model

    return Path(resolve_base_model(name_or_path))


def run_side_process(script: str, side: str, options: list[str], *, threads: int) -> dict[str, Any]:
    """Run ``script --side side *options --result-file F`` in a process of its own (so peak memory is per side)
    with ``threads`` OpenMP threads, offline; returns the JSON the side wrote to F.

    Raises:
        RuntimeError: the side failed (the end of its stderr is in the message).
    """
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, script, "--side", side, *options, "--result-file", out.name]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads)}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"side {side!r} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(Path(out.name).read_text())
