"""The public surface: what users import, without torch, and the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import art_core
import art_core.tracking
import art_plugins


def test_all_is_sorted_and_importable():
    for module in (art_core, art_core.tracking, art_plugins):
        assert module.__all__ == sorted(module.__all__)
        for name in module.__all__:
            assert getattr(module, name) is not None


def test_packages_import_without_torch():
    # sys.modules["torch"] = None makes any `import torch` fail, as on a machine without it.
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
            "import art_plugins, art_core, art_core.models, art_core.training.advantages, art_core.tracking; "
            "print(art_core.TrainConfig().loss)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "dapo"


def test_cli_lists_models():
    out = subprocess.run([sys.executable, "-m", "art_core.cli", "models"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "smollm2-135m-instruct" in out.stdout.split()


@pytest.mark.parametrize(("args", "message"), [
    (["--steps", "0"], "'--steps'"),
    (["--group-size", "1"], "'--group-size'"),  # one answer per question: nothing for GRPO to compare
    (["--learning-rate", "-1"], "'--learning-rate': -1.0 is not > 0"),
])
def test_cli_demo_refuses_bad_values_before_loading_anything(args: list[str], message: str) -> None:
    out = subprocess.run([sys.executable, "-m", "art_core.cli", "demo", *args], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 2 and message in out.stderr and "Invalid value" in out.stderr, out.stderr


async def test_run_demo_refuses_a_group_of_one_answer(tmp_path: Path) -> None:
    from art_core.demo import run_demo
    from art_core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"run_demo\(group_size=1\): give 2 or more"):
        await run_demo(group_size=1, path=tmp_path)
    assert not any(tmp_path.iterdir())  # refused before any work
