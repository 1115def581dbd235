"""The CUDA paths of ``LocalBackend``: bf16 training, vLLM sharing the trainer's GPU (sleep level 1 during a step)
or on a GPU of its own, and the Unsloth trainer. Skipped without CUDA (and each without what it needs).

The model is built from a config with random weights (a Qwen2 of ~0.5B parameters' shape, small enough to
start fast), saved with SmolLM2's tokenizer: speed and memory do not depend on the weights, and no weights
need to travel to the GPU machine.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from pathlib import Path

import httpx
import pytest
import torch

from art_core import LocalBackend, TrainableModel, TrainConfig, TrajectoryGroup, VLLMOptions

CUDA = torch.cuda.is_available() and bool(torch.version.cuda)
GPUS = torch.cuda.device_count() if CUDA else 0
REPO = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get("ART_VLLM_VENV") or REPO / ".venv-vllm")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA)")]

needs_vllm = pytest.mark.skipif(not (VLLM_VENV / "bin" / "python").is_file(),
                                reason=f"no vLLM venv at {VLLM_VENV} (pip install 'art-core[vllm]' in a venv of its own)")
BF16_GAP = 0.1
"""Sampler-vs-trainer log-prob gap allowed in bf16 (vLLM's kernels and PyTorch's round differently; fp32: 1e-5)."""


@pytest.fixture(scope="module")
def gpu_model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=896, intermediate_size=4864, num_hidden_layers=8,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=8192, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                         torch_dtype="bfloat16")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    folder = tmp_path_factory.mktemp("gpu-qwen2")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


async def _health(model: TrainableModel) -> dict:
    """The gateway's ``/health``, with ``engine`` asked of the engine now (the route serves the engine's last
    background check, up to about a second old: a short sleep would slip between two checks)."""
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        health = (await http.get(model.base_url.removesuffix("/v1") + "/health")).json()
    backend = model.backend
    assert isinstance(backend, LocalBackend)
    return {**health, "engine": await backend.gateway(model.spec).engine.health()}


async def _group(model: TrainableModel) -> TrajectoryGroup:
    trajectories = await model.sample([{"role": "user", "content": "Count to ten."}], n=8, max_tokens=32,
                                      temperature=1.0, seed=0)
    for i, trajectory in enumerate(trajectories):
        trajectory.reward = float(i % 3)
    return TrajectoryGroup(trajectories)


async def _train_steps(model: TrainableModel, steps: int) -> list[dict]:
    rows = []
    for step in range(steps):
        group = await _group(model)
        assert all(t.calls[0].adapter_step == step for t in group.trajectories)
        metrics = await model.train([group], config=TrainConfig(learning_rate=1e-4))
        assert metrics["trained"] == 1.0 and model.step == step + 1
        assert metrics["samples_rerendered"] == 0
        print(f"\nstep {model.step}: train {metrics['seconds_total']:.2f} s, adapter load "
              f"{metrics.get('seconds_adapter_load', 0.0):.3f} s, log-prob gap {metrics['sampler_logprob_abs_diff']:.2e}")
        rows.append(metrics)
    return rows


async def test_transformers_engine_trains_in_bf16(gpu_model_dir: Path, tmp_path: Path) -> None:
    model = TrainableModel(name="bf16", base_model=gpu_model_dir)
    async with LocalBackend(path=tmp_path, device="cuda", show_progress=False) as backend:
        await model.register(backend)
        for metrics in await _train_steps(model, 2):
            assert metrics["sampler_logprob_abs_diff"] < BF16_GAP


@needs_vllm
async def test_shared_gpu_vllm_sleeps_while_a_step_trains(gpu_model_dir: Path, tmp_path: Path) -> None:
    model = TrainableModel(name="shared", base_model=gpu_model_dir)
    backend = LocalBackend(path=tmp_path, inference="vllm", device="cuda", show_progress=False,
                           vllm=VLLMOptions(python=str(VLLM_VENV), gpu_memory_utilization=0.4))
    async with backend:
        await model.register(backend)
        engine = (await _health(model))["engine"]
        assert not engine["sleeping"]
        free_awake, _ = torch.cuda.mem_get_info(0)
        group = await _group(model)
        step = asyncio.create_task(model.train([group], config=TrainConfig(learning_rate=1e-4)))
        slept, free_asleep = False, free_awake
        while not step.done():  # vLLM sleeps from the pause until the new adapter is loaded
            health = (await _health(model))["engine"]
            if health["sleeping"]:
                slept, free_asleep = True, max(free_asleep, torch.cuda.mem_get_info(0)[0])
            await asyncio.sleep(0.05)
        metrics = await step
        assert slept and not (await _health(model))["engine"]["sleeping"]
        print(f"\nfree GPU memory: {free_awake / 2**30:.1f} GiB with vLLM awake, up to {free_asleep / 2**30:.1f} GiB "
              f"while it slept; adapter load {metrics['seconds_adapter_load']:.3f} s")
        assert free_asleep > free_awake + 2**30  # level 1 frees the KV cache and the weights (to CPU RAM)
        assert metrics["sampler_logprob_abs_diff"] < BF16_GAP
        assert (await _health(model))["adapter_step"] == 1


@needs_vllm
@pytest.mark.skipif(GPUS < 2, reason="the dedicated layout needs two GPUs")
async def test_dedicated_gpus_keep_vllm_awake_on_its_own_device(gpu_model_dir: Path, tmp_path: Path) -> None:
    model = TrainableModel(name="dedicated", base_model=gpu_model_dir)
    free_before = torch.cuda.mem_get_info(1)[0]
    backend = LocalBackend(path=tmp_path, inference="vllm", device="cuda:0", inference_device="cuda:1",
                           vllm=VLLMOptions(python=str(VLLM_VENV)), show_progress=False)
    async with backend:
        await model.register(backend)
        assert torch.cuda.mem_get_info(1)[0] < free_before - 2**30  # vLLM took GPU 1
        for metrics in await _train_steps(model, 2):
            assert metrics["sampler_logprob_abs_diff"] < BF16_GAP
        assert not (await _health(model))["engine"]["sleeping"]


@pytest.mark.skipif(importlib.util.find_spec("unsloth") is None, reason="needs pip install 'art-core[unsloth]'")
async def test_unsloth_trainer_writes_adapters_both_engines_load(gpu_model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = TrainableModel(name="unsloth", base_model=gpu_model_dir)
    async with LocalBackend(path=tmp_path, trainer="unsloth", device="cuda", show_progress=False) as backend:
        await model.register(backend)
        for metrics in await _train_steps(model, 2):
            assert metrics["seconds_adapter_load"] > 0  # the transformers engine loaded Unsloth's checkpoint
            assert metrics["sampler_logprob_abs_diff"] < BF16_GAP
    checkpoint = model.model_dir / "checkpoints" / "0002"
    base = AutoModelForCausalLM.from_pretrained(gpu_model_dir, dtype=torch.bfloat16)
    PeftModel.from_pretrained(base, checkpoint)  # a plain PEFT adapter
    if (VLLM_VENV / "bin" / "python").is_file():
        resumed = TrainableModel(name="unsloth", base_model=gpu_model_dir)
        async with LocalBackend(path=tmp_path, inference="vllm", vllm=VLLMOptions(python=str(VLLM_VENV)),
                                show_progress=False) as backend:
            assert await backend.register(resumed.spec) == 2  # vLLM loaded checkpoint 2 at start
            assert (await backend.sample(resumed.spec, [{"role": "user", "content": "Hi"}], n=1, max_tokens=4,
                                         temperature=0.0, tools=None, seed=None))[0].calls[0].adapter_step == 2
