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
    (["--threads", "-1"], "'--threads'"),
    (["--path", __file__], "is a file"),  # it would end in NotADirectoryError's traceback mid-run
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


async def test_a_backend_path_that_cannot_be_a_folder_is_refused_at_register_naming_it(tmp_path: Path) -> None:
    from art_core import LocalBackend, TrainableModel
    from art_core.errors import ConfigError

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    model = TrainableModel(name="m", project="p", base_model="no-such-model")  # refused before it is looked up
    async with LocalBackend(path=a_file / "runs") as backend:
        with pytest.raises(ConfigError, match=r"LocalBackend\(path='.*a-file/runs'\) cannot make the folder of "
                                              r"model 'm', .*: .*a-file is a file; give path= a folder"):
            await model.register(backend)
    assert a_file.is_file()


def test_the_cli_prints_a_warning_as_one_line_and_restores_the_display_after(capsys) -> None:
    """A warning of ours raised under ``art-core demo`` points at no line of the user's (it named a typer frame)."""
    import warnings

    from art_core.cli import warnings_as_lines
    from art_core.training.advantages import ZeroVarianceGroupsWarning

    before = warnings.showwarning
    with warnings_as_lines():
        warnings.warn(ZeroVarianceGroupsWarning("1 of 4 group(s) had equal rewards"), stacklevel=1)
    assert capsys.readouterr().err == "warning: ZeroVarianceGroupsWarning: 1 of 4 group(s) had equal rewards\n"
    assert warnings.showwarning is before


def test_cli_serve_ends_an_engine_it_cannot_start_in_one_line(tmp_path: Path) -> None:
    """Found after the settings check (starting the engine): the error's text and exit 1, no traceback."""
    env = {**os.environ, "ART_VLLM_VENV": str(tmp_path / "no-venv")}
    out = subprocess.run([sys.executable, "-m", "art_core.cli", "serve", "--inference", "vllm", "--port", "0",
                          "--path", str(tmp_path / "art")], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 1, out.stderr
    assert out.stderr.startswith("error: no vLLM python at") and "Traceback" not in out.stderr, out.stderr
