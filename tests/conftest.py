"""Shared test set-up: offline hubs, pinned threads, a clean environment per test, and two models.

Models for tests (both session-scoped, both local, nothing is downloaded):

- ``smollm2_dir``: the embedded SmolLM2-135M-Instruct, converted into the art-core cache on first use
  (~15-40 s once per cache; honours ``ART_CACHE_DIR``), then loaded from there in ~0.3 s.
- ``tiny_model_dir``: a 2-layer, hidden-64 random Qwen2 (3.2M parameters) with SmolLM2's tokenizer and
  tool chat template, for tests that need a real model but not a good one (a LoRA step takes ~0.7 s).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import module_order

# One torch thread per test process. Measured here (2 cores, a decode-sized matmul loop): 2 threads ran 1.6x
# faster than 1 on a quiet machine but 2.5x slower than 1 beside one busy process (OpenMP's threads wait
# for each other), and the suite must pass quiet or loaded; pytest-xdist's two workers use the second core.
TORCH_THREADS = 1
# The same for the Python processes tests start (README snippets, Trackio's child, servers), through the variable
# torch's default thread count follows; code that sets its own count (Ray actors, `art-core serve --threads`)
# still does. Measured: the README's Agents SDK snippet took 61 s beside a busy core on torch's default of two
# threads, 38 s on one (35 s on a quiet machine); beside the other xdist worker it had taken 184 s.
_SUBPROCESS_THREADS = {"OMP_NUM_THREADS": str(TORCH_THREADS)}
# litellm (the RULER judge client) fetches its price list from the internet on import unless told not to.
# MLflow starts a telemetry thread on import; offline, its fetch fails and it pops an environment variable while
# our tracker's thread may be iterating os.environ (requests reads the proxies from it): the tracker call fails
# with KeyError('_MLFLOW_TELEMETRY_SESSION_ID') and that step's report is lost (seen once in a loaded CI run).
_SESSION_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "MLFLOW_DISABLE_TELEMETRY": "true", **_SUBPROCESS_THREADS}
_env_before_session: dict[str, str | None] = {}


def pytest_configure(config: pytest.Config) -> None:
    # Set here, before collection, because huggingface_hub reads HF_HUB_OFFLINE once, when a test module
    # first imports it; a fixture would come too late.
    for key, value in _SESSION_ENV.items():
        _env_before_session[key] = os.environ.get(key)
        os.environ[key] = value
    if importlib.util.find_spec("torch") is not None:
        import torch

        torch.set_num_threads(TORCH_THREADS)
    # Slow modules first (module_order.py): the workers collect in that order, and xdist's scheduler must not
    # re-sort the modules by their number of tests.
    if getattr(config.option, "dist", "no") in ("loadfile", "loadscope"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker (xdist's own test); a plain run keeps the collection order
        module_order.slow_modules_first(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    # Collection imports every test module: one that sets torch's thread count at import time would run the
    # whole suite on its count, silently (a module of loss tests once did, overriding the count above).
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.get_num_threads() != TORCH_THREADS:
            raise pytest.UsageError(f"a test module set torch's thread count to {torch.get_num_threads()} when "
                                    f"imported (the suite runs on {TORCH_THREADS}): set it in a fixture that "
                                    "restores it")


def pytest_unconfigure(config: pytest.Config) -> None:
    for key, value in _env_before_session.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def _restore_environ() -> Iterator[None]:
    """Undo whatever a test did to ``os.environ``."""
    before = dict(os.environ)
    yield
    for key in set(os.environ) - set(before):
        del os.environ[key]
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a local transformers folder (fp32 safetensors)."""
    from art_core.models import EMBEDDED_MODEL, resolve_base_model

    return resolve_base_model(EMBEDDED_MODEL)


@pytest.fixture(scope="session")
def tiny_model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2ForCausalLM saved with SmolLM2's tokenizer (tool chat template included)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = Qwen2Config(
        vocab_size=len(tokenizer),  # 49152: every SmolLM2 token id is valid
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        tie_word_embeddings=True,  # as SmolLM2, so adapters see the same layout
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the tests' global RNG
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
