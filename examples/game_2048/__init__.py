"""2048 on a small board, the model moving through a tool (``python -m examples.game_2048``).

``--demos N`` warm-starts with SFT on N games first: the same graph in demonstration mode, its model's moves made
by an expectimax player (``expert.py``) that stands in for a strong hosted model.
"""

from __future__ import annotations

import asyncio

from rich.console import Console

from art_core import TrainableModel

from .._common import (ExampleSettings, LearningResult, demonstration_tasks, graph_at, graph_demonstrations, learn,
                       open_backend, parse_settings, run_name)
from .agent import MODEL_NAME, build_graph, make_tasks, reward
from .expert import expectimax_expert

__all__ = ["DEFAULTS", "EVAL_TEMPERATURE", "main", "run"]

DEFAULTS = ExampleSettings(steps=1, groups=1, rollouts=6, held_out=16, eval_rollouts=1, learning_rate=1e-4,
                           demos=32, sft_epochs=2, sft_unique_turns=True, sft_batch_size=8)
"""For 2 CPU cores (a game is up to 10 model calls, an evaluation of 16 games about 3 minutes): SFT on the
positions of 32 of the expert's games (2 epochs, about 8 minutes), then one GRPO step of 6 games at a rate ten times
below RL alone's (at 1e-3 the GRPO steps undid the warm start: 25% of held-out games won after SFT on 8 games, 0%
after 6 steps); about 18 minutes in all (with 2 groups of 6, 20.2: over the examples' 20-minute bar).
``--demos 0 --learning-rate 1e-3``: RL alone."""

EVAL_TEMPERATURE = 0.3
"""The held-out games are played at this temperature, the training games at 1.0 (GRPO needs varied games to
compare): evaluating near the policy's most likely moves, as is usual, instead of one sample of them."""


async def run(settings: ExampleSettings = DEFAULTS, *, console: Console | None = None,
              name: str | None = None) -> LearningResult:
    """Train the 2048 player; held-out success is the share of games reaching the target tile."""
    console = console or Console(soft_wrap=True)
    model = TrainableModel(name=name or run_name(MODEL_NAME), project="game_2048",
                           base_model=settings.base_model, report_to=list(settings.report_to))
    async with open_backend(settings) as backend:
        await model.register(backend)
        agent, play = graph_at(build_graph, model, MODEL_NAME, temperature=1.0, reward=reward,
                               recursion_limit=32)
        _, measure = graph_at(build_graph, model, MODEL_NAME, temperature=EVAL_TEMPERATURE, reward=reward,
                              recursion_limit=32)

        # The same graph; its moves are the expectimax expert's instead of the trainable model's, each recorded.
        demonstrate = graph_demonstrations(agent, expectimax_expert, dict, lambda game: reward)
        eval_tasks = make_tasks(settings.held_out, seed=settings.seed + 10_000)
        demo_tasks = demonstration_tasks(make_tasks, settings.demos, seed=settings.seed + 20_000, held_out=eval_tasks)
        console.print(f"[bold]game_2048[/]: {settings.base_model} plays 2048 (3x3 board, target 16)"
                      + (f", after SFT on {settings.demos} expectimax games" if settings.demos else ""))
        return await learn(model, play, train_tasks=make_tasks(settings.steps * settings.groups, seed=settings.seed),
                           eval_tasks=eval_tasks, settings=settings, measure=measure, console=console,
                           title="game_2048: reaching 16 on a 3x3 board", demonstrate=demonstrate,
                           demo_tasks=demo_tasks)


def main(argv: list[str] | None = None) -> LearningResult:
    """``python -m examples.game_2048 [--steps N ...]``."""
    settings = parse_settings("Train a LangGraph 2048 player (move tool) with GRPO.", DEFAULTS, argv)
    return asyncio.run(run(settings))
