"""The README's Python snippets, run as written (FastAPI runs its tutorial's examples the same way).

The rule, for every ```python block of README.md:

- ``<!-- snippet: runs -->`` on the line before the block: the block is a complete program; it is run as
  written in a subprocess (the repo's ``PYTHONPATH``, a fresh temp dir as its working directory) and must
  exit 0. A snippet that trains is sized to run in well under a minute on a 2-core CPU.
- ``<!-- snippet: compile-only: <reason> -->``: a complete program that needs what a test machine lacks
  (a GPU, a server, a hosted key); it is compiled only, and the reason says what it needs.
- no marker: a fragment (names defined elsewhere, top-level ``await``); it is compiled only.

Every block must compile (top-level ``await`` allowed), and a block that is a complete program (it calls
``asyncio.run(...)`` at top level) must carry one of the two markers, so a snippet added later is either
run or says why not.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

_FENCE = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)
_MARKER = re.compile(r"<!--\s*snippet:\s*(runs|compile-only:\s*(?P<reason>\S.*?))\s*-->\s*\Z")
_ADDER_LINE = re.compile(r"^step (\d+): mean reward (\d+\.\d+)$", re.MULTILINE)


@dataclass(frozen=True)
class Snippet:
    """One ```python block of the README."""

    line: int
    """Line of README.md where the block's code starts (1-based)."""
    code: str
    marker: str | None
    """"runs", "compile-only", or None for an unmarked fragment."""

    @property
    def id(self) -> str:
        return f"README.md:{self.line}"


def readme_snippets(text: str) -> list[Snippet]:
    """Every ```python block of ``text``, with the marker on the last non-blank line before it, if any."""
    snippets = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip().rsplit("\n", 1)[-1]
        marker = _MARKER.search(before)
        kind = None if marker is None else ("runs" if marker.group(1) == "runs" else "compile-only")
        line = text.count("\n", 0, match.start(1)) + 1
        snippets.append(Snippet(line=line, code=match.group(1), marker=kind))
    return snippets


def _is_complete_program(code: str) -> bool:
    """True when the block runs itself: an ``asyncio.run(...)`` call among its top-level statements."""
    tree = compile(code, "<snippet>", "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    for node in tree.body:
        call = node.value if isinstance(node, ast.Expr) else None
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "run"
                and isinstance(call.func.value, ast.Name) and call.func.value.id == "asyncio"):
            return True
    return False


SNIPPETS = readme_snippets(README.read_text())
RUNNABLE = [s for s in SNIPPETS if s.marker == "runs"]


def test_the_readme_has_runnable_snippets() -> None:
    # The parser must find the README's blocks at all, or every parametrized test below would vanish.
    assert len(SNIPPETS) >= 10, f"found {len(SNIPPETS)} ```python blocks in README.md"
    assert any("name=\"adder\"" in s.code for s in RUNNABLE), "the Training loop's adder snippet is not marked runs"


def test_the_rule_reads_markers_and_fragments() -> None:
    text = (
        "intro\n\n<!-- snippet: runs -->\n```python\nimport asyncio\nasyncio.run(main())\n```\n\n"
        "<!-- snippet: compile-only: needs a Ray cluster -->\n```python\nasyncio.run(main())\n```\n\n"
        "no marker here\n```python\nawait model.train(groups)\n```\n"
    )
    runs, compile_only, fragment = readme_snippets(text)
    assert (runs.marker, runs.line, runs.code) == ("runs", 5, "import asyncio\nasyncio.run(main())\n")
    assert (compile_only.marker, compile_only.line) == ("compile-only", 11)
    assert fragment.marker is None and fragment.code == "await model.train(groups)\n"
    assert _is_complete_program(runs.code) and not _is_complete_program(fragment.code)
    # A compile-only marker without its reason is no marker.
    assert readme_snippets("<!-- snippet: compile-only -->\n```python\nx = 1\n```\n")[0].marker is None


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda s: s.id)
def test_every_snippet_compiles_and_complete_programs_are_marked(snippet: Snippet) -> None:
    compile(snippet.code, snippet.id, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    if snippet.marker is None and _is_complete_program(snippet.code):
        pytest.fail(f"{snippet.id} is a complete program (it calls asyncio.run) with no marker: put "
                    "'<!-- snippet: runs -->' on the line before its ```python fence so this test runs it, or "
                    "'<!-- snippet: compile-only: <what it needs> -->' if it needs a GPU, a server or a key")


def _run(snippet: Snippet, workdir: Path) -> subprocess.CompletedProcess[str]:
    """Run the block as a user would (``python snippet.py`` in an empty folder), with the repo importable."""
    script = workdir / "snippet.py"
    script.write_text(snippet.code)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "core"), str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # The timeout only keeps a hung snippet from hanging the suite; it is not a measure of speed.
    return subprocess.run([sys.executable, str(script)], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=1800)


@pytest.mark.slow
@pytest.mark.parametrize("snippet", RUNNABLE, ids=lambda s: s.id)
def test_runnable_snippet_runs_as_written(snippet: Snippet, tmp_path: Path) -> None:
    result = _run(snippet, tmp_path)
    print(result.stdout)  # what a user would see (pytest -rA shows it)
    assert result.returncode == 0, (
        f"{snippet.id} exited with {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}")
    if 'name="adder"' in snippet.code:
        _check_adder_learns(result.stdout)


def _check_adder_learns(stdout: str) -> None:
    """The Training loop's snippet prints ``step N: mean reward R`` per step, and R must rise."""
    steps = [(int(step), float(reward)) for step, reward in _ADDER_LINE.findall(stdout)]
    assert [s for s, _ in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 3, stdout
    rewards = [r for _, r in steps]
    # The first step's reward is the base model's; the last two are after training. One step's mean over
    # 8 replies is noisy, so the end is the mean of two steps.
    assert (rewards[-1] + rewards[-2]) / 2 > rewards[0], f"the adder's reward did not rise: {rewards}"
