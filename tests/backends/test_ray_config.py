"""RayBackend's checks that need no cluster: bad arguments, rollout import paths, and no Ray at import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from art_core import ConfigError, RayBackend, TransformersOptions, VLLMOptions
from art_core.backends.ray.rollouts import import_rollout


def test_importing_art_core_does_not_import_ray() -> None:
    code = "import sys, art_core; from art_core import RayBackend; print('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True
                          ).stdout.strip() == "False"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"inference_replicas": 0}, "inference_replicas must be at least 1"),
    ({"trainer_workers": 0}, "trainer_workers must be at least 1"),
    ({"inference": "sglang"}, "use 'transformers' or 'vllm'"),
    ({"inference": "vllm", "vllm": VLLMOptions(python="/no/such/venv")}, "no vLLM python at /no/such/venv"),
    ({"sharding": "zero3"}, "use 'none', 'fsdp' or 'auto'"),
    ({"resources": {"gpu-nodes": {"a100": 1}}}, "unknown role"),
    ({"inference": "vllm", "transformers": TransformersOptions()}, "transformers= options need inference="),
    ({"transformers": {"packed_weights": True}}, "takes a TransformersOptions, not dict"),
])
def test_bad_arguments_name_the_problem(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RayBackend(**kwargs)


def test_rollout_import_paths() -> None:
    assert import_rollout("json:dumps").__name__ == "dumps"
    with pytest.raises(ConfigError, match="not an import path"):
        import_rollout("json.dumps")
    with pytest.raises(ConfigError, match="cannot import 'no_such_module_xyz'"):
        import_rollout("no_such_module_xyz:run")
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        import_rollout("json:nope")


def test_the_api_key_argument_does_not_hide_the_contract_method() -> None:
    assert callable(RayBackend(api_key="k" * 24).api_key)


async def test_closing_an_unused_backend_needs_no_ray() -> None:
    backend = RayBackend()
    await backend.aclose()
    await backend.aclose()
