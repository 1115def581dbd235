"""A support desk on the OpenAI Agents SDK: triage, handoffs, tools, structured output
(``python -m examples.agents_sdk_support``).

``--demos N`` warm-starts with SFT on N conversations first: the same agents run by
``TrainableRunner.demonstrations(teacher)``, their calls answered by a scripted expert (``expert.py``) that stands in
for a strong hosted model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from rich.console import Console

from art_core import Trajectory, TrainableModel, TrajectoryGroup
from art_plugins.openai_agents import TrainableRunner

from .._common import (ExampleSettings, LearningResult, demonstration_tasks, learn, open_backend, parse_settings,
                       run_name)
from .agent import MODEL_NAME, SupportTask, build_agent, make_tasks, reward
from .expert import support_expert

__all__ = ["DEFAULTS", "EVAL_TEMPERATURE", "main", "run"]

DEFAULTS = ExampleSettings(steps=4, groups=2, rollouts=6, held_out=16, eval_rollouts=1, learning_rate=1e-4,
                           demos=48, sft_unique_turns=True, sft_batch_size=8)
"""For 2 CPU cores, about 17 minutes (a run is 3-6 model calls): SFT on the distinct turns of 48 of the expert's
conversations (half billing, half technical; about 70 turns, 3 epochs), then 4 GRPO steps at a rate ten times below
RL alone's (at 1e-3 after the warm start, a step's rollouts fell to a quarter valid calls).
``--demos 0 --learning-rate 1e-3``: RL alone."""

EVAL_TEMPERATURE = 0.3
"""The held-out runs sample at this temperature, the training runs at 1.0 (GRPO needs varied runs to compare):
evaluating near the policy's most likely replies, as is usual, instead of one sample of them."""


async def run(settings: ExampleSettings = DEFAULTS, *, console: Console | None = None,
              name: str | None = None) -> LearningResult:
    """Train the support desk; held-out success: the right department and the looked-up fact in the reply."""
    console = console or Console(soft_wrap=True)
    model = TrainableModel(name=name or run_name(MODEL_NAME), project="agents_sdk_support",
                           base_model=settings.base_model, report_to=list(settings.report_to))
    async with open_backend(settings) as backend:
        await model.register(backend)
        runner = TrainableRunner(model, model_names=[MODEL_NAME], timeout=600)
        agent = build_agent()

        def runs_of(desk: Any) -> Any:
            """``play(task, n, seed)``: ``n`` scored runs of the desk ``desk`` on a task."""
            async def play(task: SupportTask, n: int, seed: int) -> TrajectoryGroup:
                return await runner.group(desk, task.message, n=n, reward=reward(task), max_turns=6, seed=seed)

            return play

        play, measure = runs_of(agent), runs_of(build_agent(temperature=EVAL_TEMPERATURE))

        async def demonstrate(tasks: Sequence[SupportTask]) -> list[Trajectory]:
            # The same agents; their calls answered by the expert instead of the trainable model, each run recorded.
            async with support_expert() as expert, runner.demonstrations(expert.teacher) as demo:
                runs = await asyncio.gather(*(demo.run(agent, task.message, reward=reward(task), max_turns=6)
                                              for task in tasks))
            return [trajectory for _, trajectory in runs]

        eval_tasks = make_tasks(settings.held_out, seed=settings.seed + 10_000)
        demo_tasks = demonstration_tasks(make_tasks, settings.demos, seed=settings.seed + 20_000, held_out=eval_tasks)
        console.print(f"[bold]agents_sdk_support[/]: an Agents SDK triage desk on {settings.base_model}"
                      + (f", after SFT on {settings.demos} demonstrations" if settings.demos else ""))
        return await learn(model, play, train_tasks=make_tasks(settings.steps * settings.groups, seed=settings.seed),
                           eval_tasks=eval_tasks, settings=settings, measure=measure, console=console,
                           title="agents_sdk_support: triage, handoff, tool, structured answer",
                           demonstrate=demonstrate, demo_tasks=demo_tasks)


def main(argv: list[str] | None = None) -> LearningResult:
    """``python -m examples.agents_sdk_support [--steps N ...]``."""
    import asyncio

    settings = parse_settings("Train an Agents SDK support desk (handoffs, tools, output_type) with GRPO.",
                              DEFAULTS, argv)
    return asyncio.run(run(settings))
