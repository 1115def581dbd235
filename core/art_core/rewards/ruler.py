"""RULER: an LLM judge scores a group's trajectories relative to each other; the scores become rewards.

    scored = await ruler_score_group(group, "openai/o4-mini")            # any litellm model string
    scored = await ruler_score_group(group, "openai/judge", api_base=gateway.base_url, api_key="local")

GRPO only needs rewards that rank the runs of one task correctly, and a judge that sees all of them at
once ranks far more reliably than one that scores each alone. One group, top to bottom:

    check the arguments -> for each of `orders` seeded shuffles:
        prompt (_prompt.py) -> cache hit? -> else judge call (_judge.py) -> check the answer (_answer.py)
                                                   ^-- malformed: repair prompt, up to max_repairs times
    -> scores averaged over orders, per trajectory -> a scored copy of the group

What it adds to OpenPipe's RULER: trajectories reach the judge in a seeded random order (position bias),
optionally in several orders whose scores are averaged; a malformed or incomplete answer gets a repair
prompt before it is an error; answers are cached on disk by content hash; usage and cost are summed
(``JudgeUsage``); additional histories are shown to the judge; and scores per assistant step can be asked
for (``step_rewards=True``).

The input group is never modified: on success a scored copy is returned, so on any error every
trajectory keeps its original reward.
"""

from __future__ import annotations

import enum
import logging
import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError, JudgeError, RewardError
from ..types import Trajectory, TrajectoryGroup
from ._answer import Judgement, MalformedAnswer, parse_answer
from ._cache import JudgeCache, cache_key, default_cache_dir
from ._judge import JudgeUsage, call_judge
from ._prompt import DEFAULT_RUBRIC, JudgePrompt, build_judge_prompt, repair_message
from ._tasks import gather_or_cancel

__all__ = ["DEFAULT_CACHE", "ruler_score_group", "ruler_step_scores"]

logger = logging.getLogger(__name__)


class _Default(enum.Enum):
    CACHE = "default"


DEFAULT_CACHE = _Default.CACHE
"""``cache_dir``'s default: ``$ART_CACHE_DIR/ruler`` (``~/.cache/art-core/ruler``). ``None`` turns caching off."""


async def ruler_score_group(
    group: TrajectoryGroup,
    judge: str,
    *,
    rubric: str | None = None,
    api_base: str | None = None,
    api_key: str | None = None,
    seed: int = 0,
    orders: int = 1,
    max_repairs: int = 2,
    swallow_exceptions: bool = False,
    cache_dir: str | os.PathLike[str] | None | _Default = DEFAULT_CACHE,
    step_rewards: bool = False,
    explanation_max_chars: int | None = 300,
    completion_kwargs: Mapping[str, Any] | None = None,
    usage: JudgeUsage | None = None,
) -> TrajectoryGroup | None:
    """Score every trajectory of ``group`` with one judge call per order; return a scored copy.

    In the copy, each trajectory's ``reward`` is its RULER score (mean over orders), and its ``metrics``
    keep ``reward_before_ruler`` (the reward it came with) and ``ruler_score`` (plus ``ruler_score_spread``,
    max minus min over orders, when ``orders > 1``, and ``ruler_step_{k}`` per step with ``step_rewards``).
    The judge's explanations are appended to ``logs``. The copy's ``metadata`` holds the group's judge
    usage (``ruler_calls``, ``ruler_cache_hits``, ``ruler_prompt_tokens``, ``ruler_cost_usd``...).

    Args:
        group: the trajectories to compare (runs of one task).
        judge: a litellm model string: ``"openai/o4-mini"``, ``"anthropic/claude-sonnet-4-5"``, or
            ``"openai/<served-name>"`` with ``api_base`` for any OpenAI-compatible server (our gateway, vLLM).
        rubric: what a good run looks like. Default: ``DEFAULT_RUBRIC`` (goal, then quality, then efficiency).
        api_base: the judge server's base URL (e.g. ``gateway.base_url``); None: litellm's default for the provider.
        api_key: the key for ``api_base`` or the provider; None: litellm reads the provider's environment variable.
        seed: seeds the shuffles, so a re-run shows the judge the same orders (and hits the cache).
        orders: how many shuffled orders to judge; each trajectory's score is the mean over them. More
            orders cancel more position bias, at one judge call each.
        max_repairs: repair prompts sent after a malformed or incomplete answer before giving up.
        swallow_exceptions: on a ``RewardError`` (judge unreachable, answer still malformed, empty group),
            log a warning, count it in ``usage.failures`` and return None instead of raising.
        cache_dir: folder of the on-disk answer cache (default ``DEFAULT_CACHE``); None: no cache.
        step_rewards: also ask for a score per assistant message of each run's main history, stored as
            ``metrics["ruler_step_{k}"]`` (``k`` from 1) and read back with ``ruler_step_scores(trajectory)``.
        explanation_max_chars: ``maxLength`` of each explanation in the answer schema; it bounds what a
            small constrained judge writes. None: unbounded.
        completion_kwargs: more ``litellm.acompletion`` arguments (``temperature``, ``max_tokens``,
            ``timeout``, ``num_retries``...); part of the cache key.
        usage: a ``JudgeUsage`` to add this group's calls, tokens, cost and failures to.

    Returns:
        The scored copy, or None when ``swallow_exceptions`` is set and the group could not be scored.

    Raises:
        ConfigError: an argument is invalid (``orders < 1``, ``max_repairs < 0``, an empty ``judge``...).
        RewardError: the group is empty.
        JudgeError: the judge failed, or its answer was still malformed after ``max_repairs`` repairs
            (e.g. it scored fewer trajectories than it was shown).
    """
    _check_arguments(judge, orders, max_repairs, explanation_max_chars)
    rubric = DEFAULT_RUBRIC if rubric is None else rubric
    cache = None
    if isinstance(cache_dir, _Default):
        cache = JudgeCache(default_cache_dir())
    elif cache_dir is not None:
        cache = JudgeCache(Path(cache_dir))
    spent = JudgeUsage()
    try:
        if not group.trajectories:
            raise RewardError("the group has no trajectories: nothing to judge (were all its rollouts dropped? "
                              f"its exceptions: {group.exceptions[:3]})")
        n = len(group.trajectories)
        permutations = [_order(seed, k, n) for k in range(orders)]
        # one order failed: the group fails, so stop paying for the others
        answers = await gather_or_cancel(_judge_order(
            group, permutation, seed=seed, order=k, judge=judge, rubric=rubric, api_base=api_base, api_key=api_key,
            max_repairs=max_repairs, cache=cache, step_rewards=step_rewards,
            explanation_max_chars=explanation_max_chars, completion_kwargs=dict(completion_kwargs or {}),
            spent=spent) for k, permutation in enumerate(permutations))
    except RewardError as exc:
        spent.failures = 1
        if usage is not None:
            usage.add(spent)
        if not swallow_exceptions:
            raise
        logger.warning("RULER left a group of %d unscored (swallow_exceptions=True): %s", len(group), exc)
        return None
    if usage is not None:
        usage.add(spent)
    return _scored_copy(group, permutations, answers, judge=judge, spent=spent)


def ruler_step_scores(trajectory: Trajectory) -> list[float]:
    """The per-step scores RULER stored with ``step_rewards=True`` (``metrics["ruler_step_{k}"]``), in order.

    Step ``k`` is the ``k``-th assistant message of the trajectory's main history. Empty when none were stored.
    """
    scores = []
    while f"ruler_step_{len(scores) + 1}" in trajectory.metrics:
        scores.append(float(trajectory.metrics[f"ruler_step_{len(scores) + 1}"]))
    return scores


# --- one order: prompt -> cache or judge (with repairs) -> checked answer ---------------------------


async def _judge_order(group: TrajectoryGroup, permutation: list[int], *, seed: int, order: int, judge: str,
                       rubric: str, api_base: str | None, api_key: str | None, max_repairs: int,
                       cache: JudgeCache | None, step_rewards: bool, explanation_max_chars: int | None,
                       completion_kwargs: dict[str, Any], spent: JudgeUsage) -> dict[str, Judgement]:
    prompt = build_judge_prompt([group.trajectories[i] for i in permutation], rubric=rubric,
                                step_rewards=step_rewards, explanation_max_chars=explanation_max_chars)
    key = cache_key({"judge": judge, "rubric": rubric, "seed": seed, "order": order, "messages": prompt.messages,
                     "schema": prompt.schema, "completion_kwargs": completion_kwargs})
    if cache is not None and (hit := cache.get(key)) is not None and set(hit) == set(prompt.labels):
        spent.cache_hits += 1
        return hit
    judgements, cost = await _ask_with_repairs(prompt, judge=judge, api_base=api_base, api_key=api_key,
                                               max_repairs=max_repairs, completion_kwargs=completion_kwargs,
                                               spent=spent)
    if cache is not None:
        cache.put(key, judgements, usage={"prompt_tokens": cost.prompt_tokens,
                                          "completion_tokens": cost.completion_tokens, "cost_usd": cost.cost_usd})
    return judgements


async def _ask_with_repairs(prompt: JudgePrompt, *, judge: str, api_base: str | None, api_key: str | None,
                            max_repairs: int, completion_kwargs: dict[str, Any], spent: JudgeUsage
                            ) -> tuple[dict[str, Judgement], JudgeUsage]:
    """Ask, check, and on a malformed answer ask again with the problem stated, up to ``max_repairs`` times.

    Returns:
        The checked answer and what this order cost; every call is also added to ``spent`` as it is made,
        so the calls of a group that fails are still counted.
    """
    messages = list(prompt.messages)
    cost = JudgeUsage()
    for attempt in range(max_repairs + 1):
        reply = await call_judge(judge, messages, schema=prompt.schema, api_base=api_base, api_key=api_key,
                                 completion_kwargs=completion_kwargs)
        cost.add(reply.usage)
        spent.add(reply.usage)
        try:
            return parse_answer(reply.text, prompt), cost
        except MalformedAnswer as exc:
            problem = str(exc)
            if reply.finish_reason == "length":
                problem += " (the answer was cut off at the token limit: keep explanations short)"
            logger.info("RULER judge %s answered malformed output (attempt %d of %d): %s", judge, attempt + 1,
                        max_repairs + 1, problem)
            if attempt == max_repairs:
                raise JudgeError(
                    f"the judge {judge!r} answered malformed output {max_repairs + 1} time(s) for a group of "
                    f"{len(prompt.labels)}: {problem}; answer starts: {(reply.text or '')[:200]!r}. Try a "
                    "stronger judge, a larger max_tokens in completion_kwargs, or more max_repairs") from exc
            cost.repairs += 1
            spent.repairs += 1
            messages = [*messages, {"role": "assistant", "content": reply.text or ""}, repair_message(problem, prompt)]
    raise AssertionError("unreachable")  # the loop returns or raises


# --- helpers ------------------------------------------------------------------------------------------


def _check_arguments(judge: str, orders: int, max_repairs: int, explanation_max_chars: int | None) -> None:
    problems = []
    if not isinstance(judge, str) or not judge.strip():
        problems.append(f"judge is {judge!r}: pass a litellm model string such as 'openai/o4-mini'")
    if orders < 1:
        problems.append(f"orders is {orders}: judge at least 1 order")
    if max_repairs < 0:
        problems.append(f"max_repairs is {max_repairs}: use 0 for no repair prompt")
    if explanation_max_chars is not None and explanation_max_chars < 1:
        problems.append(f"explanation_max_chars is {explanation_max_chars}: use a positive number, or None")
    if problems:
        raise ConfigError("ruler_score_group: " + "; ".join(problems))


def _order(seed: int, order: int, n: int) -> list[int]:
    """The ``order``-th shuffle of ``range(n)`` for ``seed``: the same on every run and machine."""
    permutation = list(range(n))
    random.Random(seed * 1_000_003 + order).shuffle(permutation)
    return permutation


def _scored_copy(group: TrajectoryGroup, permutations: list[list[int]], answers: list[dict[str, Judgement]],
                 *, judge: str, spent: JudgeUsage) -> TrajectoryGroup:
    scored = group.model_copy(deep=True)
    orders = len(permutations)
    for index, trajectory in enumerate(scored.trajectories):
        verdicts = []
        for k, (permutation, answer) in enumerate(zip(permutations, answers, strict=True)):
            label = f"trajectory_{permutation.index(index) + 1}"  # where this run sat in order k
            verdict = answer[label]
            verdicts.append(verdict)
            where = f"order {k + 1}/{orders}, " if orders > 1 else ""
            trajectory.logs.append(f"RULER ({judge}, {where}shown as {label}): score {verdict.score:.3f}: "
                                   f"{verdict.explanation}")
        scores = [v.score for v in verdicts]
        metrics = dict(trajectory.metrics)
        metrics["reward_before_ruler"] = trajectory.reward
        metrics["ruler_score"] = sum(scores) / orders
        if orders > 1:
            metrics["ruler_score_spread"] = max(scores) - min(scores)
        step_scores = [v.step_scores for v in verdicts if v.step_scores is not None]
        if step_scores:  # the same steps in every order: the schema fixed how many
            for step, per_order in enumerate(zip(*step_scores, strict=True), start=1):
                metrics[f"ruler_step_{step}"] = sum(per_order) / len(per_order)
        trajectory.metrics = metrics
        trajectory.reward = metrics["ruler_score"]
    scored.metadata = {**scored.metadata, "ruler_judge": judge, **spent.as_metadata()}
    return scored
