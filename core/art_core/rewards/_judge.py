"""One request to an LLM judge through litellm, and the usage and cost it adds up to.

litellm is imported here, inside the call, so ``import art_core.rewards`` stays light (``pip install
'art-core[rewards]'`` brings it). Set ``LITELLM_LOCAL_MODEL_COST_MAP=True`` on machines without internet:
litellm otherwise fetches its price list when first imported. Every litellm failure (connection refused,
timeout, bad request, authentication) becomes a ``JudgeError`` that names the judge, with the cause kept.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import JudgeError

__all__ = ["JudgeReply", "JudgeUsage", "call_judge"]

logger = logging.getLogger(__name__)


@dataclass
class JudgeUsage:
    """Judge calls and what they cost, summed. Pass one to every ``ruler_score_group`` of a training step
    to total the step; each scored group also carries its own totals in ``metadata`` (``ruler_*``).
    """

    calls: int = 0
    """Requests sent to the judge, repair prompts included."""
    cache_hits: int = 0
    """Judge answers read from the on-disk cache instead of asked for (free)."""
    repairs: int = 0
    """Repair prompts sent after a malformed answer."""
    failures: int = 0
    """Groups left unscored: ``ruler_score_group`` returned None under ``swallow_exceptions=True``."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    """Summed over the calls litellm could price."""
    unpriced_calls: int = 0
    """Calls litellm has no price for (local judges, custom endpoints): not in ``cost_usd``."""

    def add(self, other: JudgeUsage) -> None:
        """Add ``other``'s counts to these."""
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    def as_metadata(self, prefix: str = "ruler_") -> dict[str, int | float]:
        """The counts as flat ``{prefix + name: value}`` (what a scored group's ``metadata`` gets)."""
        return {f"{prefix}{name}": value for name, value in asdict(self).items()}


@dataclass(frozen=True)
class JudgeReply:
    """The judge's answer text and what the call cost."""

    text: str | None
    finish_reason: str | None
    usage: JudgeUsage
    """This call alone: ``calls=1`` and its tokens and cost."""


async def call_judge(
    judge: str,
    messages: list[dict[str, Any]],
    *,
    schema: dict[str, Any],
    api_base: str | None,
    api_key: str | None,
    completion_kwargs: Mapping[str, Any],
) -> JudgeReply:
    """Ask ``judge`` (any litellm model string) for a JSON answer following ``schema``.

    The schema goes as ``response_format`` ``json_schema`` with ``strict: False``: constrained-decoding
    servers (our gateway, vLLM) enforce it fully, and hosted APIs whose strict mode refuses ``maxLength``
    or numeric bounds still accept it. The answer is checked by the caller either way.

    Raises:
        JudgeError: litellm failed (unreachable, timeout, refused, authentication...; the cause is kept), or the
            answer has no choices.
    """
    try:
        import litellm
    except ImportError as exc:
        raise JudgeError("LLM judges need litellm: pip install 'art-core[rewards]'") from exc
    response_format = {"type": "json_schema", "json_schema": {"name": "ruler_scores", "schema": schema,
                                                              "strict": False}}
    try:
        response = await litellm.acompletion(model=judge, messages=messages, response_format=response_format,
                                             api_base=api_base, api_key=api_key, **dict(completion_kwargs))
    except Exception as exc:  # litellm maps every provider error to its own types; all end the same way
        where = f" at {api_base}" if api_base else ""
        raise JudgeError(f"the judge {judge!r}{where} failed: {type(exc).__name__}: {_first_line(exc)}; "
                         "check the model name, api_base and api_key, and that the server is up") from exc
    if not getattr(response, "choices", None):
        where = f" at {api_base}" if api_base else ""
        raise JudgeError(f"the judge {judge!r}{where} answered with no choices: check that the server speaks "
                         "OpenAI's chat completions API")
    choice = response.choices[0]
    usage = JudgeUsage(calls=1)
    if getattr(response, "usage", None) is not None:
        usage.prompt_tokens = int(response.usage.prompt_tokens or 0)
        usage.completion_tokens = int(response.usage.completion_tokens or 0)
    cost = _cost(litellm, response)
    if cost is None:
        usage.unpriced_calls = 1
    else:
        usage.cost_usd = cost
    return JudgeReply(choice.message.content, getattr(choice, "finish_reason", None), usage)


def _cost(litellm: Any, response: Any) -> float | None:
    """The call's price in USD, or None when litellm does not know the model's price."""
    hidden = getattr(response, "_hidden_params", None) or {}
    if hidden.get("response_cost") is not None:
        return float(hidden["response_cost"])
    try:
        return float(litellm.completion_cost(completion_response=response))
    except Exception as exc:  # litellm raises for models missing from its price list: unpriced, counted
        logger.debug("no price for the judge call: %s", exc)
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "(no message)"
