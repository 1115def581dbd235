"""Does each example learn? Held-out success before and after training, RL alone or SFT + RL, fixed seeds.

    python tests/benchmarks/learning.py                         # every example, its own defaults, seed 0
    python tests/benchmarks/learning.py --only tic_tac_toe --seeds 0 1 2 --demos 0     # RL alone
    python tests/benchmarks/learning.py --only tic_tac_toe --seeds 0 1 2 --demos 128   # SFT on 128 demos, then RL
    python tests/benchmarks/learning.py --only game_2048 --steps 2 --held-out 8        # override other defaults
    python tests/benchmarks/learning.py --table-only            # no runs: re-render from the stored ones

Each (example, recipe, seed) run is the example's own ``run`` (``examples/<name>``): the held-out success rate
of the base model, with ``--demos N`` (N > 0) an SFT step on N teacher demonstrations and the success rate
after it, ``steps`` GRPO steps, the success rate again. The recipe is ``RL`` (``--demos 0``) or
``SFT+RL (N demos)``; without ``--demos`` it is the example's default (``DEFAULTS.demos``).

Results accumulate in ``--out`` (default ``.art/benchmarks``), one JSON file per run,
``learning-<example>-<rl|sftN>-seed<k>.json`` (older ``learning-<example>-seed<k>.json`` files are read too).
A run whose file exists is skipped (``--rerun`` runs it again), so a long measurement can be split into
several invocations, or resumed after an interruption, and RL-alone and SFT+RL runs live side by side.
Each invocation rewrites, over every stored run, ``learning.md`` (a markdown table, one row per example and
recipe) and ``learning.png`` (the mean training reward per GRPO step of every run, one panel per example and
recipe). The last line printed is a JSON object, success rates in [0, 1]: ``<example>_before`` and
``<example>_after`` (means over seeds of the example's default recipe), ``<example>_recipe``, ``<example>_seeds``,
``<example>_before_per_seed`` and ``<example>_after_per_seed``, and for every recipe ``<example>_<rl|sftN>_before``,
``..._after``, ``..._after_sft`` (SFT recipes) and ``..._per_seed`` (``[seed, before, after]`` lists).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import json
import multiprocessing
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from examples._common import ExampleSettings

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "core")]

EXAMPLES = ["langgraph_tools", "agents_sdk_support", "tic_tac_toe", "game_2048", "email_search", "ruler_only"]

Row = dict[str, Any]
RecipeKey = tuple[str, int]
"""(example, demos): demos 0 is RL alone."""
# A file named by the current scheme; anything else matching learning-*-seed*.json is an old-style file.
NEW_STYLE = re.compile(r"learning-.+-(rl|sft\d+)-seed\d+\.json")


# -- recipes and files ---------------------------------------------------------------------------------

def recipe_label(demos: int, unique_turns: bool = False) -> str:
    if demos == 0:
        return "RL"
    return f"SFT+RL ({demos} demos{', distinct turns' if unique_turns else ''})"


def runs_label(demos: int, runs: list[Row]) -> str:
    """The recipe as the stored runs name it (their own label says whether SFT trained distinct turns)."""
    labels = sorted({str(r.get("recipe") or recipe_label(demos)) for r in runs})
    return " / ".join(labels)


def recipe_slug(demos: int) -> str:
    return "rl" if demos == 0 else f"sft{demos}"


def row_path(out: Path, name: str, demos: int, seed: int) -> Path:
    return out / f"learning-{name}-{recipe_slug(demos)}-seed{seed}.json"


def row_demos(row: Row) -> int:
    """The demonstrations a stored run's recipe asked for; old rows without settings were RL alone."""
    settings = row.get("settings") or {}
    return int(settings.get("demos", row.get("demos", 0)))


def example_defaults(name: str) -> ExampleSettings | None:
    """The example's ``DEFAULTS`` (None when its module cannot be imported here)."""
    try:
        return importlib.import_module(f"examples.{name}").DEFAULTS
    except Exception as error:  # any failure to import only costs the default recipe: keep rendering
        print(f"(examples.{name} not importable, {type(error).__name__}: {error})", file=sys.stderr)
        return None


# -- running -------------------------------------------------------------------------------------------

def run_one(name: str, seed: int, out: Path, overrides: dict[str, object], demos: int) -> Row:
    """One run (its recipe's ``demos``), in a process of its own, stored in ``out``; its row.

    A fresh interpreter per run: langchain-openai caches one async HTTP client per process, bound to the event
    loop of the run that made it, so a second run's ``asyncio.run`` in the same process failed its model calls
    with "Event loop is closed" (counted as lost games).
    """
    child = multiprocessing.get_context("spawn").Process(target=_run_here, args=(name, seed, out, overrides))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise SystemExit(f"{name} seed {seed}: the run's process exited with code {child.exitcode}")
    return json.loads(row_path(out, name, demos, seed).read_text())


def _run_here(name: str, seed: int, out: Path, overrides: dict[str, object]) -> None:
    from rich.console import Console

    module = importlib.import_module(f"examples.{name}")
    settings = dataclasses.replace(module.DEFAULTS, seed=seed, path=out / "runs", **overrides)
    slug = recipe_slug(settings.demos)
    result = asyncio.run(module.run(settings, console=Console(soft_wrap=True),
                                    name=f"{name}-{slug}-seed{seed}-{int(time.time())}"))
    row = {"example": name, "seed": seed, "recipe": recipe_label(settings.demos, settings.sft_unique_turns),
           **result.to_json(),
           "settings": {k: str(v) for k, v in dataclasses.asdict(settings).items()}}
    row_path(out, name, settings.demos, seed).write_text(json.dumps(row, indent=1))


def settings_drift(stored: Row, wanted: ExampleSettings) -> str:
    """How the settings asked for now differ from a stored run's (empty: they agree)."""
    differ = [f"{k} {stored['settings'][k]} stored, {v} asked" for k, v in dataclasses.asdict(wanted).items()
              if k not in ("seed", "path") and k in stored.get("settings", {}) and stored["settings"][k] != str(v)]
    return "; ".join(differ)


def run_all(names: list[str], seeds: list[int], out: Path, overrides: dict[str, object], rerun: bool) -> None:
    stored = stored_rows(out)
    for name in names:
        wanted = dataclasses.replace(importlib.import_module(f"examples.{name}").DEFAULTS, **overrides)
        demos = wanted.demos
        for seed in seeds:
            label = f"{name} {recipe_label(demos)} seed {seed}"
            if (name, demos, seed) in stored and not rerun:
                path, row = stored[(name, demos, seed)]
                drift = settings_drift(row, wanted)
                print(f"{label}: skipped, stored in {path.name} (--rerun to run it again)"
                      + (f"; note: {drift}" if drift else ""), flush=True)
                continue
            row = run_one(name, seed, out, overrides, demos)
            after_sft = f" -> {row['success_after_sft']:.1%} (SFT)" if row.get("success_after_sft") is not None else ""
            print(f"{label}: {row['success_before']:.1%}{after_sft} -> {row['success_after']:.1%}", flush=True)


# -- stored runs ---------------------------------------------------------------------------------------

def stored_rows(out: Path) -> dict[tuple[str, int, int], tuple[Path, Row]]:
    """Every stored run by (example, demos, seed); a new-style file wins over an old-style one of the same run."""
    paths = sorted(out.glob("learning-*-seed*.json"), key=lambda p: (bool(NEW_STYLE.fullmatch(p.name)), p.name))
    found: dict[tuple[str, int, int], tuple[Path, Row]] = {}
    for path in paths:
        row = json.loads(path.read_text())
        found[(str(row["example"]), row_demos(row), int(row["seed"]))] = (path, row)
    return found


def load_rows(out: Path) -> dict[RecipeKey, list[Row]]:
    """Stored runs by (example, demos), in table order (EXAMPLES, then RL before SFT+RL), each by seed."""
    rows: dict[RecipeKey, list[Row]] = {}
    for (name, demos, _), (_, row) in stored_rows(out).items():
        rows.setdefault((name, demos), []).append(row)

    def order(key: RecipeKey) -> tuple[int, str, int]:
        return (EXAMPLES.index(key[0]) if key[0] in EXAMPLES else len(EXAMPLES), key[0], key[1])

    return {key: sorted(rows[key], key=lambda r: int(r["seed"])) for key in sorted(rows, key=order)}


def _mean(runs: list[Row], field: str) -> float | None:
    """Mean of a success field over runs (None when no run has it: RL alone has no after-SFT rate)."""
    values = [float(r[field]) for r in runs if r.get(field) is not None]
    return statistics.mean(values) if values else None


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def _shape(settings: dict[str, str]) -> str:
    return f"{settings['steps']} x {settings['groups']} x {settings['rollouts']}"


def _held_out_runs(settings: dict[str, str]) -> str:
    return str(int(settings["held_out"]) * int(settings["eval_rollouts"]))


def _distinct(runs: list[Row], describe: Callable[[dict[str, str]], str]) -> str:
    """A setting over the runs: one value, or each distinct one (runs stored with other overrides)."""
    return " / ".join(dict.fromkeys(describe(r["settings"]) for r in runs))


# -- table, figure, summary ----------------------------------------------------------------------------

def write_table(rows: dict[RecipeKey, list[Row]], out: Path) -> str:
    lines = ["| example | recipe | seeds | steps x groups x rollouts | held-out runs | before | after SFT | after | "
             "change | minutes per run | max minutes |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (name, demos), runs in rows.items():
        before, after = _mean(runs, "success_before"), _mean(runs, "success_after")
        per_seed = ", ".join(f"{float(r['success_before']):.1%}→{float(r['success_after']):.1%}" for r in runs)
        minutes = [float(r["seconds"]) / 60 for r in runs]
        lines.append(
            f"| {name} | {runs_label(demos, runs)} | {', '.join(str(r['seed']) for r in runs)} | "
            f"{_distinct(runs, _shape)} | {_distinct(runs, _held_out_runs)} | "
            f"{_pct(before)} | {_pct(_mean(runs, 'success_after_sft') if demos else None)} | {_pct(after)} | "
            f"{((after or 0) - (before or 0)) * 100:+.1f} pts ({per_seed}) | "
            f"{statistics.mean(minutes):.1f} | {max(minutes):.1f} |")
    table = "\n".join(lines) + "\n"
    (out / "learning.md").write_text(table)
    return table


def plot(rows: dict[RecipeKey, list[Row]], out: Path) -> Path | None:
    """``learning.png``: one line of panels per example, one panel per recipe (RL alone first, so that it sits
    beside SFT+RL on a shared reward axis), each with the mean training reward per GRPO step of every seed and the
    held-out success (means over seeds) in its title."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        print("(matplotlib is not installed: no learning.png)", file=sys.stderr)
        return None
    if not rows:
        return None
    panels: dict[str, list[RecipeKey]] = {}
    for key in rows:
        panels.setdefault(key[0], []).append(key)
    cols = max(len(keys) for keys in panels.values())
    fig, axes = plt.subplots(len(panels), cols, figsize=(4.6 * cols, 3.3 * len(panels)), squeeze=False)
    for line, keys in zip(axes, panels.values()):
        for ax, (name, demos) in zip(line, keys):
            _panel(ax, name, demos, rows[(name, demos)])
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if ax is not line[0]:
                ax.sharey(line[0])
        for ax in line[len(keys):]:
            ax.set_visible(False)
    fig.tight_layout()
    path = out / "learning.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _panel(ax: Any, name: str, demos: int, runs: list[Row]) -> None:
    for r in runs:
        steps = r["steps"]
        ax.plot([s["step"] for s in steps], [s["reward_mean"] for s in steps], marker=".", label=f"seed {r['seed']}")
    success = [_mean(runs, "success_before"), _mean(runs, "success_after")]
    if demos:
        success.insert(1, _mean(runs, "success_after_sft"))
    held_out = "→".join("–" if v is None else f"{v:.0%}" for v in success)
    ax.set_title(f"{name} {runs_label(demos, runs)}\nheld-out success {held_out}", fontsize=9)
    ax.set(xlabel="GRPO step", ylabel="training reward (mean)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def default_recipe(name: str, recipes: dict[int, list[Row]]) -> int:
    """The demos of the example's default recipe; if it was not run, the recipe with most seeds (RL on a tie)."""
    defaults = example_defaults(name)
    if defaults is not None and defaults.demos in recipes:
        return int(defaults.demos)
    return max(recipes, key=lambda demos: (len(recipes[demos]), -demos))


def summary(rows: dict[RecipeKey, list[Row]]) -> dict[str, object]:
    """The last JSON line: per example its default recipe's figures, then every recipe's."""
    by_example: dict[str, dict[int, list[Row]]] = {}
    for (name, demos), runs in rows.items():
        by_example.setdefault(name, {})[demos] = runs
    figures: dict[str, object] = {}
    for name, recipes in by_example.items():
        demos = default_recipe(name, recipes)
        runs = recipes[demos]
        figures[f"{name}_before"] = round(_mean(runs, "success_before") or 0.0, 4)
        figures[f"{name}_after"] = round(_mean(runs, "success_after") or 0.0, 4)
        figures[f"{name}_recipe"] = runs_label(demos, runs)
        figures[f"{name}_seeds"] = len(runs)
        figures[f"{name}_before_per_seed"] = [round(float(r["success_before"]), 4) for r in runs]
        figures[f"{name}_after_per_seed"] = [round(float(r["success_after"]), 4) for r in runs]
        for demos, runs in recipes.items():
            prefix = f"{name}_{recipe_slug(demos)}"
            figures[f"{prefix}_before"] = round(_mean(runs, "success_before") or 0.0, 4)
            figures[f"{prefix}_after"] = round(_mean(runs, "success_after") or 0.0, 4)
            if demos:
                after_sft = _mean(runs, "success_after_sft")
                figures[f"{prefix}_after_sft"] = None if after_sft is None else round(after_sft, 4)
            figures[f"{prefix}_per_seed"] = [
                [int(r["seed"]), round(float(r["success_before"]), 4), round(float(r["success_after"]), 4)]
                for r in runs]
    return figures


# -- command line --------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict[str, object]]:
    """The flags, and the overrides of the examples' defaults they ask for."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=EXAMPLES, nargs="+", help="these examples (default: all)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds to run (default: 0)")
    for flag in ("steps", "groups", "rollouts", "held-out", "eval-rollouts"):
        parser.add_argument(f"--{flag}", type=int, help=f"override the example's default {flag.replace('-', ' ')}")
    parser.add_argument("--demos", type=int,
                        help="SFT warm start on N demonstrations before RL; 0: RL alone (default: the example's)")
    parser.add_argument("--learning-rate", type=float, help="override the example's GRPO learning rate")
    parser.add_argument("--base-model", help="override the base model (a registered name or a local folder)")
    parser.add_argument("--out", type=Path, default=ROOT / ".art" / "benchmarks",
                        help="where runs are stored and the table, figure are written (default: %(default)s)")
    parser.add_argument("--rerun", action="store_true", help="run again the runs already stored in --out")
    parser.add_argument("--table-only", action="store_true",
                        help="no runs: rewrite the table, figure and JSON line from the runs stored in --out")
    args = parser.parse_args(argv)
    if args.table_only and args.rerun:
        parser.error("--rerun runs; --table-only does not")
    if args.demos is not None and args.demos < 0:
        parser.error(f"--demos must be at least 0, got {args.demos}")
    if args.learning_rate is not None and not args.learning_rate > 0:
        parser.error(f"--learning-rate must be positive, got {args.learning_rate}")
    keys = ("steps", "groups", "rollouts", "held_out", "eval_rollouts", "demos", "learning_rate", "base_model")
    return args, {key: getattr(args, key) for key in keys if getattr(args, key) is not None}


def main(argv: list[str] | None = None) -> None:
    args, overrides = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        names, seeds = list(dict.fromkeys(args.only or EXAMPLES)), list(dict.fromkeys(args.seeds))
        run_all(names, seeds, args.out, overrides, args.rerun)
    rows = load_rows(args.out)
    print(write_table(rows, args.out))
    png = plot(rows, args.out)
    if png is not None:
        print(f"figure: {png}")
    print(json.dumps(summary(rows)), flush=True)  # last line: what scripts read


if __name__ == "__main__":
    main()
