"""RULER as the only reward: an LLM judge ranks each group's runs (``python -m examples.ruler_only``).

``--judge`` is any litellm model string (``openai/o4-mini``; the provider's key from its environment
variable). The default, ``local``, judges offline with the base model itself on a second gateway: the
gateway constrains its answer to RULER's JSON schema (llguidance), so even a 135M model returns valid
scores. It is a weak judge, and this example shows what that gives (see examples/README.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

from rich.console import Console

from art_core import JudgeError, TrainableModel, Trajectory, TrajectoryGroup
from art_core.errors import ConfigError
from art_core.rewards import ruler_score_group
from art_plugins.langgraph import trainable

from .._common import ExampleSettings, LearningResult, learn, open_backend, parse_settings, run_name
from .agent import MODEL_NAME, CapitalTask, build_graph, check, make_tasks

__all__ = ["DEFAULTS", "Judged", "judge_endpoint", "main", "run"]

logger = logging.getLogger(__name__)

DEFAULTS = ExampleSettings(steps=6, groups=2, rollouts=6, held_out=12, eval_rollouts=2, learning_rate=1e-3,
                           judge="local")
"""Small, for 2 CPU cores: each group costs one judge call."""


@contextlib.asynccontextmanager
async def judge_endpoint(settings: ExampleSettings) -> AsyncIterator[dict[str, Any]]:
    """The arguments for ``ruler_score_group``: a remote judge as given, or the base model on a local gateway."""
    if settings.judge != "local":
        yield {"judge": settings.judge}
        return
    from art_core.engines.transformers import TransformersEngine
    from art_core.gateway import Gateway, GatewaySettings
    from art_core.models import resolve_base_model

    engine = await TransformersEngine.from_pretrained(resolve_base_model(settings.base_model))
    try:
        async with Gateway(engine, GatewaySettings(model_name="judge")) as gateway:
            yield {"judge": "openai/judge", "api_base": gateway.base_url, "api_key": "local",
                   "completion_kwargs": {"temperature": 0, "max_tokens": 400}}
    finally:
        await engine.aclose()


class Judged:
    """``ruler_score_group`` over a run's groups. A failed judge call keeps the group as it was (a warning says
    so), but a judge that fails on each of the first ``give_up_after`` groups ends the run with its error: a
    wrong model name or a missing key would otherwise train a whole run on no judgement at all.

    Args:
        judge: ``judge_endpoint``'s arguments for ``ruler_score_group``.
        options: more of its arguments (``rubric``...).
    """

    def __init__(self, judge: dict[str, Any], *, give_up_after: int = 3, **options: Any) -> None:
        self.judge, self.options, self.give_up_after = judge, options, give_up_after
        self.scored = self.failed = 0

    async def __call__(self, group: TrajectoryGroup, seed: int) -> TrajectoryGroup:
        try:
            scored = await ruler_score_group(group, seed=seed, **self.judge, **self.options)
        except JudgeError as exc:
            self.failed += 1
            if not self.scored and self.failed >= self.give_up_after:
                raise ConfigError(f"the RULER judge {self.judge['judge']!r} failed on each of the first "
                                  f"{self.failed} groups, so nothing would be judged; last: {exc}") from exc
            logger.warning("RULER left a group unscored (it keeps its rewards): %s", exc)
            return group
        self.scored += 1
        return scored


async def run(settings: ExampleSettings = DEFAULTS, *, console: Console | None = None,
              name: str | None = None) -> LearningResult:
    """Train the assistant on RULER's scores; held-out success (measured by a checker): the right capital."""
    console = console or Console(soft_wrap=True)
    if not settings.judge:
        settings = dataclasses.replace(settings, judge="local")
    model = TrainableModel(name=name or run_name(MODEL_NAME), project="ruler_only",
                           base_model=settings.base_model, report_to=list(settings.report_to))
    async with open_backend(settings) as backend, judge_endpoint(settings) as judge:
        await model.register(backend)
        agent = trainable(build_graph(), model, model_names=[MODEL_NAME], timeout=300)

        def measured(task: CapitalTask) -> Any:
            def note(trajectory: Trajectory, state: Any) -> float:
                check(task, trajectory, state)  # sets metrics["success"]; the reward stays unset here
                return 0.0
            return note

        judged = Judged(judge)  # a failed judge call leaves the group's rewards equal: no signal from it

        async def play(task: CapitalTask, n: int, seed: int) -> TrajectoryGroup:
            return await judged(await agent.group(task.input(), n=n, reward=measured(task), seed=seed), seed)

        async def measure(task: CapitalTask, n: int, seed: int) -> TrajectoryGroup:
            return await agent.group(task.input(), n=n, reward=measured(task), seed=seed)

        console.print(f"[bold]ruler_only[/]: {settings.base_model} trained on RULER scores from judge "
                      f"{settings.judge!r}")
        return await learn(model, play, measure=measure,
                           train_tasks=make_tasks(settings.steps * settings.groups, seed=settings.seed),
                           eval_tasks=make_tasks(settings.held_out, seed=settings.seed + 10_000, held_out=True),
                           settings=settings, console=console, title="ruler_only: RULER-scored answers")


def main(argv: list[str] | None = None) -> LearningResult:
    """``python -m examples.ruler_only [--judge openai/o4-mini ...]``."""
    import asyncio

    settings = parse_settings("Train a LangGraph assistant on RULER scores alone (no hand-written reward).",
                              DEFAULTS, argv, judged=True, teacher=False)
    return asyncio.run(run(settings))
