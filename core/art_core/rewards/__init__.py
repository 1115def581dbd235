"""Rewards: RULER (an LLM judge that scores a group's runs relative to each other) and custom reward functions.

    from art_core.rewards import ruler_score_group, score_group

    scored = await ruler_score_group(group, "openai/o4-mini")                     # reward := judge's score
    scored = await score_group(group, {"correct": correct}, final_states=states)  # reward := weighted sum

Modules, one job each: ``ruler.py`` (the RULER flow), ``_prompt.py`` (what the judge reads and the answer
schema), ``_answer.py`` (checking the answer), ``_judge.py`` (the litellm call, usage and cost),
``_cache.py`` (answers on disk), ``custom.py`` (reward functions and weights), ``_tasks.py`` (concurrent calls
that stop together). Importing this package
imports neither litellm nor torch; judges need ``pip install 'art-core[rewards]'``.
"""

from ._judge import JudgeUsage
from ._prompt import DEFAULT_RUBRIC
from .custom import GroupScorer, RewardFn, reward_value, score_group
from .ruler import DEFAULT_CACHE, ruler_score_group, ruler_step_scores

__all__ = [
    "DEFAULT_CACHE",
    "DEFAULT_RUBRIC",
    "GroupScorer",
    "JudgeUsage",
    "RewardFn",
    "reward_value",
    "ruler_score_group",
    "ruler_step_scores",
    "score_group",
]
