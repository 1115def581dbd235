"""The public surface: what users import, without torch, and the CLI."""

from __future__ import annotations

import subprocess
import sys

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
