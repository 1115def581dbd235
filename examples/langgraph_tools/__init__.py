"""The demo: a LangGraph calculator agent learns to use its tools (``python -m examples.langgraph_tools``).

The graph (``agent.py``) is unchanged LangGraph code; ``art_plugins.langgraph.trainable`` runs it on the
trainable model and returns each run as a token-exact trajectory, scored by the job's reward (right tool
call, then the right answer). ``make demo`` runs this with its defaults on the embedded SmolLM2-135M.

``--demos N`` warm-starts with SFT on N demonstrations first: the same graph in demonstration mode, its model's
calls answered by a scripted expert (``expert.py``) that stands in for a strong hosted model.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console

from art_core import TrainableModel, TrajectoryGroup
from art_plugins.langgraph import trainable

from .. import _common
from .._common import (ExampleSettings, LearningResult, graph_demonstrations, learn, open_backend, parse_settings,
                       run_name)
from .agent import MODEL_NAME, CalcTask, build_graph, make_tasks, reward
from .expert import calculator_expert

__all__ = ["DEFAULTS", "demonstration_tasks", "main", "run"]

DEFAULTS = ExampleSettings(steps=5, groups=2, rollouts=6, held_out=20, eval_rollouts=2, learning_rate=2e-3)
"""Sized for 2 CPU cores: about 10 minutes on the embedded model."""


async def run(settings: ExampleSettings = DEFAULTS, *, console: Console | None = None,
              name: str | None = None) -> LearningResult:
    """Train the calculator agent and measure its held-out success before and after.

    Args:
        settings: the example's flags (see ``examples._common.ExampleSettings``).
        console: where to print progress.
        name: the model's folder name; default: a fresh one per run, so a run never resumes an old one.

    Returns:
        Held-out success before and after, each step's figures, where the checkpoints and the curve are.
    """
    console = console or Console(soft_wrap=True)
    model = TrainableModel(name=name or run_name(MODEL_NAME), project="langgraph_tools",
                           base_model=settings.base_model, report_to=list(settings.report_to))
    async with open_backend(settings) as backend:
        await model.register(backend)
        # The graph names its model "calc"; trainable() routes those calls to the trainable model.
        agent = trainable(build_graph(), model, model_names=[MODEL_NAME], recursion_limit=8, timeout=300)

        async def play(task: CalcTask, n: int, seed: int) -> TrajectoryGroup:
            return await agent.group(task.input(), n=n, reward=reward(task), seed=seed)

        # The same graph; its "calc" calls go to the expert instead of the gateway, and each run is recorded.
        demonstrate = graph_demonstrations(agent, calculator_expert, CalcTask.input, reward)

        eval_tasks = make_tasks(settings.held_out, seed=settings.seed + 10_000)
        console.print(f"[bold]langgraph_tools[/]: a LangGraph calculator agent on {settings.base_model}, "
                      f"{settings.steps} steps x {settings.groups} questions x {settings.rollouts} rollouts"
                      + (f", after SFT on {settings.demos} demonstrations" if settings.demos else ""))
        return await learn(model, play, train_tasks=make_tasks(settings.steps * settings.groups, seed=settings.seed),
                           eval_tasks=eval_tasks, settings=settings, console=console,
                           title="langgraph_tools: calculator agent", demonstrate=demonstrate,
                           demo_tasks=demonstration_tasks(settings.demos, seed=settings.seed + 20_000,
                                                          held_out=eval_tasks))


def demonstration_tasks(n: int, *, seed: int, held_out: Sequence[CalcTask]) -> list[CalcTask]:
    """``n`` questions for demonstrations, drawn from their own seed, none of them a held-out question."""
    return _common.demonstration_tasks(make_tasks, n, seed=seed, held_out=held_out)


def main(argv: list[str] | None = None) -> LearningResult:
    """``python -m examples.langgraph_tools [--steps N ...]``."""
    import asyncio

    settings = parse_settings("Train a LangGraph calculator agent (tool call + answer) with GRPO.", DEFAULTS, argv)
    return asyncio.run(run(settings))
