"""Email search, the ART•E task at CPU scale: a LangGraph agent answers questions about a synthetic inbox
(``python -m examples.email_search``).

The mailbox (``mailbox.py``) is a few hundred seeded emails in SQLite with an FTS5 index; each question's
answer sits in one email. The agent (``agent.py``) searches, reads and answers with the id of its source.
Rewards come from the hand-written reward in ``agent.py`` (right answer, right source, partial credit for
finding and reading the email), or with ``--judge MODEL`` from RULER (``ruler_score_group``: the judge
compares each group's runs; ``--judge local`` uses the base model on this machine). Either way the
held-out success is measured by the checker: the right answer citing the right email.

It warm-starts with SFT on ``--demos N`` questions first (24 by default; ``--demos 0``: RL alone): the same graph
in demonstration mode, its model's calls answered by a scripted expert (``expert.py``) that stands in for a strong
hosted model.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

from art_core import TrainableModel, TrajectoryGroup
from art_core.errors import ConfigError

from .._common import (ExampleSettings, LearningResult, graph_at, graph_demonstrations, learn, open_backend,
                       parse_settings, run_name)
from ..ruler_only import Judged, judge_endpoint
from .agent import MAX_TURNS, MODEL_NAME, build_graph, reward, task_input
from .expert import email_expert
from .mailbox import Mailbox, Question

__all__ = ["DEFAULTS", "EVAL_TEMPERATURE", "RUBRIC", "demonstration_questions", "main", "run", "split_questions"]

DEFAULTS = ExampleSettings(steps=2, groups=2, rollouts=6, held_out=16, eval_rollouts=1, learning_rate=1e-4,
                           demos=24, sft_unique_turns=True, sft_batch_size=8)
"""For 2 CPU cores (a run is 3-4 model calls): SFT on 24 of the expert's runs (about 5 minutes), then 2 GRPO steps
(about 2 minutes each) at the rate the other warm-started examples use (1e-3 undid their warm starts). Measured over
seeds 0-2: held-out success 6.2% -> 77.1%, 14.1-15.9 minutes a run (examples/README.md).
``--demos 0 --learning-rate 1e-3``: RL alone."""

EVAL_TEMPERATURE = 0.3
"""Held-out runs sample near the policy's most likely calls; training samples at 1.0, so a group's runs differ."""

RUBRIC = ("The agent must answer a question about the user's inbox with a short answer and the id of the email "
          "that contains it. A correct answer that cites the email it came from is best; an answer without the "
          "right source, or a guess made without reading any email, is worse; searching and reading the right "
          "email is better than not finding it.")
"""What the RULER judge is told good looks like (``--judge``)."""


def split_questions(mailbox: Mailbox, *, train: int, held_out: int) -> tuple[list[Question], list[Question]]:
    """Training and held-out questions, disjoint: the held-out ones are never trained on.

    Raises:
        ConfigError: the mailbox has fewer questions than asked for.
    """
    if train + held_out > len(mailbox.questions):
        raise ConfigError(f"the mailbox has {len(mailbox.questions)} questions, asked for {train} training "
                          f"(steps x groups) + {held_out} held-out; lower --steps, --groups or --held-out")
    return mailbox.questions[held_out:held_out + train], mailbox.questions[:held_out]


def demonstration_questions(mailbox: Mailbox, n: int, *, train: int, held_out: int) -> list[Question]:
    """``n`` questions for demonstrations, never a held-out one: those after the training questions first, then
    training ones (``split_questions`` takes the held-out questions from the front, then the training ones)."""
    rest = mailbox.questions[held_out:]
    return (rest[train:] + rest[:train])[:n]


async def run(settings: ExampleSettings = DEFAULTS, *, console: Console | None = None,
              name: str | None = None) -> LearningResult:
    """Train the email agent and measure its held-out success (right answer and source) before and after.

    Args:
        settings: the example's flags (see ``examples._common.ExampleSettings``); ``judge`` switches the
            training reward to RULER.
        console: where to print progress.
        name: the model's folder name; default: a fresh one per run, so a run never resumes an old one.

    Returns:
        Held-out success before and after, each step's figures, where the checkpoints and the curve are.
    """
    console = console or Console(soft_wrap=True)
    mailbox = Mailbox(seed=settings.seed)
    train_questions, eval_questions = split_questions(mailbox, train=settings.steps * settings.groups,
                                                      held_out=settings.held_out)
    model = TrainableModel(name=name or run_name(MODEL_NAME), project="email_search",
                           base_model=settings.base_model, report_to=list(settings.report_to))
    async with open_backend(settings) as backend:
        await model.register(backend)
        # The graph names its model "email-agent"; trainable() routes those calls to the trainable model.
        def at(temperature: float) -> Any:
            return graph_at(lambda temperature: build_graph(mailbox, temperature=temperature), model, MODEL_NAME,
                            temperature=temperature, recursion_limit=2 * MAX_TURNS + 2, task_input=task_input,
                            task_reward=reward)

        agent, training_play = at(1.0)
        _, measure = at(EVAL_TEMPERATURE)

        async with judge_endpoint(settings) as judge:
            ruler = Judged(judge, rubric=RUBRIC)  # a failed judge call keeps the hand reward

            async def judged(question: Question, n: int, seed: int) -> TrajectoryGroup:
                return await ruler(await training_play(question, n, seed), seed)

            # The same graph; its calls answered by the expert instead of the trainable model, each recorded.
            demonstrate = graph_demonstrations(agent, lambda: email_expert(mailbox), task_input, reward)

            play = judged if settings.judge else training_play
            source = f"RULER (judge {settings.judge!r})" if settings.judge else "the hand-written reward"
            console.print(f"[bold]email_search[/]: a LangGraph email agent on {settings.base_model}, "
                          f"{mailbox.size} emails, trained on {source}; "
                          f"{settings.steps} steps x {settings.groups} questions x {settings.rollouts} rollouts"
                          + (f", after SFT on {settings.demos} demonstrations" if settings.demos else ""))
            demo_questions = demonstration_questions(mailbox, settings.demos, train=len(train_questions),
                                                     held_out=len(eval_questions))
            return await learn(model, play, measure=measure, train_tasks=train_questions, eval_tasks=eval_questions,
                               settings=settings, console=console, title="email_search: inbox question answering",
                               demonstrate=demonstrate, demo_tasks=demo_questions)


def main(argv: list[str] | None = None) -> LearningResult:
    """``python -m examples.email_search [--steps N --judge MODEL ...]``."""
    import asyncio

    settings = parse_settings("Train a LangGraph email-search agent (search_inbox, read_email, return_answer) "
                              "with GRPO.", DEFAULTS, argv, judged=True)
    return asyncio.run(run(settings))
