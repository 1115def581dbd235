"""Does each example learn? Held-out success before and after N GRPO steps, fixed seeds.

    python tests/benchmarks/learning.py                         # every example, its own defaults, seed 0
    python tests/benchmarks/learning.py --only langgraph_tools --seeds 0 1 2
    python tests/benchmarks/learning.py --only tic_tac_toe game_2048 --steps 2 --held-out 8   # override defaults

Each (example, seed) run is the example's own ``run`` (``examples/<name>``): the held-out success rate of
the base model, ``steps`` GRPO steps, the held-out success rate again. Results accumulate in
``--out`` (default ``.art/benchmarks``): one JSON file per run, so long measurements can be split into
several invocations (``--only``) and the table still covers them all. Each invocation rewrites
``learning.md`` (a markdown table over every stored run) and ``learning-<example>.png`` (before/after per
seed, with the mean training reward per step). The last line printed is a JSON object:
``{"<example>_before": mean success before, "<example>_after": ..., "<example>_seeds": k, ...}`` over the
stored runs, success rates in [0, 1].
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "core")]

EXAMPLES = ["langgraph_tools", "agents_sdk_support", "tic_tac_toe", "game_2048", "email_search", "ruler_only"]


def run_one(name: str, seed: int, out: Path, overrides: dict[str, object]) -> dict[str, object]:
    from rich.console import Console

    module = importlib.import_module(f"examples.{name}")
    settings = dataclasses.replace(module.DEFAULTS, seed=seed, path=out / "runs", **overrides)
    result = asyncio.run(module.run(settings, console=Console(soft_wrap=True), name=f"{name}-seed{seed}-{int(__import__('time').time())}"))
    row = {"example": name, "seed": seed, **result.to_json(),
           "settings": {k: str(v) for k, v in dataclasses.asdict(settings).items()}}
    (out / f"learning-{name}-seed{seed}.json").write_text(json.dumps(row, indent=1))
    return row


def load_rows(out: Path) -> dict[str, list[dict[str, object]]]:
    rows: dict[str, list[dict[str, object]]] = {}
    for path in sorted(out.glob("learning-*-seed*.json")):
        row = json.loads(path.read_text())
        rows.setdefault(str(row["example"]), []).append(row)
    return rows


def write_table(rows: dict[str, list[dict[str, object]]], out: Path) -> str:
    lines = ["| example | seeds | steps x groups x rollouts | held-out runs | before | after | change | minutes per run |",
             "|---|---|---|---|---|---|---|---|"]
    for name in EXAMPLES:
        if name not in rows:
            continue
        runs = rows[name]
        s = runs[0]["settings"]
        before = [float(r["success_before"]) for r in runs]
        after = [float(r["success_after"]) for r in runs]
        per_seed = ", ".join(f"{b:.0%}→{a:.0%}" for b, a in zip(before, after))
        lines.append(
            f"| {name} | {len(runs)} | {s['steps']} x {s['groups']} x {s['rollouts']} | "
            f"{int(s['held_out']) * int(s['eval_rollouts'])} | {statistics.mean(before):.1%} | "
            f"{statistics.mean(after):.1%} | {(statistics.mean(after) - statistics.mean(before)) * 100:+.1f} pts "
            f"({per_seed}) | {statistics.mean(float(r['seconds']) for r in runs) / 60:.1f} |")
    table = "\n".join(lines) + "\n"
    (out / "learning.md").write_text(table)
    return table


def plot(name: str, runs: list[dict[str, object]], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in runs:
        steps = r["steps"]
        left.plot([s["step"] for s in steps], [s["reward_mean"] for s in steps], marker=".", label=f"seed {r['seed']}")
        right.plot([0, 1], [r["success_before"], r["success_after"]], marker="o", label=f"seed {r['seed']}")
    left.set(xlabel="GRPO step", ylabel="training reward (mean)", title=f"{name}: training reward")
    right.set(xticks=[0, 1], xticklabels=["before", "after"], ylabel="held-out success", ylim=(-0.02, 1.02),
              title=f"{name}: held-out success")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"learning-{name}.png", dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=EXAMPLES, nargs="+", help="these examples (default: all)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    for flag in ("steps", "groups", "rollouts", "held-out", "eval-rollouts"):
        parser.add_argument(f"--{flag}", type=int, help=f"override the example's default {flag.replace('-', ' ')}")
    parser.add_argument("--base-model", help="override the base model (a registered name or a local folder)")
    parser.add_argument("--out", type=Path, default=ROOT / ".art" / "benchmarks")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    overrides: dict[str, object] = {}
    for key in ("steps", "groups", "rollouts", "held_out", "eval_rollouts"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    if args.base_model is not None:
        overrides["base_model"] = args.base_model
    for name in args.only or EXAMPLES:
        for seed in args.seeds:
            row = run_one(name, seed, args.out, overrides)
            print(f"{name} seed {seed}: {row['success_before']:.1%} -> {row['success_after']:.1%}", flush=True)
    rows = load_rows(args.out)
    print(write_table(rows, args.out))
    figures: dict[str, float | int] = {}
    for name, runs in rows.items():
        plot(name, runs, args.out)
        figures[f"{name}_before"] = round(statistics.mean(float(r["success_before"]) for r in runs), 4)
        figures[f"{name}_after"] = round(statistics.mean(float(r["success_after"]) for r in runs), 4)
        figures[f"{name}_seeds"] = len(runs)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
