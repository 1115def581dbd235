"""Tic-tac-toe against a random opponent, the model moving through a tool (``python -m examples.tic_tac_toe``).

By default it warm-starts with SFT on the distinct turns of 512 games first (``--demos N``; 0: RL alone): the same
graph in demonstration mode, its model's moves made by a scripted expert (``expert.py``) that stands in for a strong
hosted model.
"""

from __future__ import annotations


from rich.console import Console

from art_core import TrainableModel

from .._common import (ExampleSettings, LearningResult, demonstration_tasks, graph_at, graph_demonstrations, learn,
                       open_backend, parse_settings, run_name)
from .agent import MODEL_NAME, build_graph, make_tasks, reward
from .expert import tic_tac_toe_expert

__all__ = ["DEFAULTS", "EVAL_TEMPERATURE", "main", "run"]

DEFAULTS = ExampleSettings(steps=3, groups=3, rollouts=8, held_out=32, eval_rollouts=1, learning_rate=1e-4,
                           demos=512, sft_unique_turns=True, sft_batch_size=8, sft_epochs=2)
"""For 2 CPU cores, about 14 minutes: SFT (2 epochs) on the distinct positions of 512 of the expert's games (about
300 turns: the empty board's opening, in half the games, is one sample), then 3 GRPO steps of 24 games at a rate
ten times below the other examples' (a higher one undid an earlier warm start: 26 of 32 held-out wins after SFT, 20
after 6 steps at 1e-3). ``--demos 0 --learning-rate 1e-3``: RL alone."""

EVAL_TEMPERATURE = 0.3
"""The held-out games are played at this temperature, the training games at 1.0 (GRPO needs varied games to
compare): evaluating near the policy's most likely moves, as is usual, instead of one sample of them."""


async def run(settings: ExampleSettings = DEFAULTS, *, console: Console | None = None,
              name: str | None = None) -> LearningResult:
    """Train the tic-tac-toe player; held-out success is the share of games won."""
    console = console or Console(soft_wrap=True)
    model = TrainableModel(name=name or run_name(MODEL_NAME), project="tic_tac_toe",
                           base_model=settings.base_model, report_to=list(settings.report_to))
    async with open_backend(settings) as backend:
        await model.register(backend)
        agent, play = graph_at(build_graph, model, MODEL_NAME, temperature=1.0, reward=reward,
                               recursion_limit=12)
        _, measure = graph_at(build_graph, model, MODEL_NAME, temperature=EVAL_TEMPERATURE, reward=reward,
                              recursion_limit=12)

        # The same graph; its moves are the expert's instead of the trainable model's, each recorded.
        demonstrate = graph_demonstrations(agent, tic_tac_toe_expert, dict, lambda game: reward)
        eval_tasks = make_tasks(settings.held_out, seed=settings.seed + 10_000)
        demo_tasks = demonstration_tasks(make_tasks, settings.demos, seed=settings.seed + 20_000, held_out=eval_tasks)
        console.print(f"[bold]tic_tac_toe[/]: {settings.base_model} plays X against a random O"
                      + (f", after SFT on {settings.demos} games of its expert" if settings.demos else ""))
        return await learn(model, play, train_tasks=make_tasks(settings.steps * settings.groups, seed=settings.seed),
                           eval_tasks=eval_tasks, settings=settings, measure=measure, console=console,
                           title="tic_tac_toe: wins against a random opponent", demonstrate=demonstrate,
                           demo_tasks=demo_tasks)


def main(argv: list[str] | None = None) -> LearningResult:
    """``python -m examples.tic_tac_toe [--steps N ...]``."""
    import asyncio

    settings = parse_settings("Train a LangGraph tic-tac-toe player (make_move tool) with GRPO.", DEFAULTS, argv)
    return asyncio.run(run(settings))
