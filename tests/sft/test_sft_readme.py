"""The README's "Supervised fine-tuning, then RL" example runs as written (the tiny model as its base)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

README = Path(__file__).parents[2] / "README.md"


def _example() -> str:
    section = README.read_text(encoding="utf-8").split("## Supervised fine-tuning, then RL", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


async def test_the_readmes_sft_then_rl_example_runs(tiny_model_dir, tmp_path, monkeypatch, capsys):
    code = _example()
    assert 'base_model="smollm2-135m-instruct"' in code
    code = code.replace('base_model="smollm2-135m-instruct"', f"base_model={str(tiny_model_dir)!r}")
    monkeypatch.chdir(tmp_path)  # the example writes ./sums.jsonl and ./.art
    await asyncio.to_thread(exec, compile(code, "README.md", "exec"), {"__name__": "readme"})  # asyncio.run inside

    model_dir = tmp_path / ".art" / "demo" / "models" / "adder-sft"
    rows = [json.loads(line) for line in (model_dir / "history.jsonl").read_text().splitlines()]
    assert [row["kind"] for row in rows] == ["sft", "grpo", "grpo"]
    assert rows[0]["step"] == 1 and rows[0]["optimizer_steps"] == 12.0 and rows[0]["samples_rerendered"] == 42.0
    assert json.loads((model_dir / "checkpoints" / "0001" / "checkpoint.json").read_text())["kind"] == "sft"
    assert "['sft', 'grpo', 'grpo']" in capsys.readouterr().out
