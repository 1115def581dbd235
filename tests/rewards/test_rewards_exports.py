"""The rewards package's public surface, importable without litellm or torch."""

from __future__ import annotations

import subprocess
import sys

import art_core.rewards


def test_all_is_sorted_and_importable():
    assert art_core.rewards.__all__ == sorted(art_core.rewards.__all__)
    for name in art_core.rewards.__all__:
        assert getattr(art_core.rewards, name) is not None


def test_rewards_import_without_litellm_or_torch():
    # litellm loads only when a judge is called; custom rewards need neither.
    code = ("import sys; sys.modules['litellm'] = None; sys.modules['torch'] = None; "
            "from art_core.rewards import ruler_score_group, score_group, JudgeUsage; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
