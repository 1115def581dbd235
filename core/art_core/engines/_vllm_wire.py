"""The ``/v1/completions`` wire of ``VLLMEngine``: the request body for one prompt, and its choices (whole or
streamed) read back as token-exact outputs. Apart from ``vllm.py`` so that the engine module holds the server's
lifecycle and this one the format; nothing here does I/O.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import httpx

from ..errors import EngineError
from .base import EngineOutput, SamplingParams, TokenDelta


def _completion_request(model: str, prompt_token_ids: list[int], params: SamplingParams) -> dict[str, Any]:
    """The ``/v1/completions`` body for one prompt, asking for everything a token-exact record needs."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt_token_ids),  # a list of ints is a token-id prompt: no re-tokenization
        "n": params.n,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "stop": list(params.stop),
        "seed": params.seed,
        # At least 1, so each position carries the sampled token's own logprob; vLLM adds the sampled token
        # to the top-k when it is not among them.
        "logprobs": max(1, params.top_logprobs),
        "return_token_ids": True,  # choices[i].token_ids: the sampled ids, stop token included
        "return_tokens_as_token_ids": True,  # top_logprobs keys as "token_id:123" (unique; text can collide)
        "skip_special_tokens": False,
        "top_k": 0,  # vLLM extension, 0 = off: no top-k cut, so top_p is the only filter, as in OpenAI's API
    }
    if params.json_schema is not None:
        body["structured_outputs"] = {"json": params.json_schema}
    if params.grammar is not None:
        # /v1/completions has no tool_choice (vLLM enforces it on chat requests only, and we send token ids),
        # so the gateway's tool-call grammar goes through vLLM's structured outputs instead (Lark, llguidance).
        body["structured_outputs"] = {"grammar": params.grammar}
    return body


def _parse_choice(choice: dict[str, Any], params: SamplingParams, step: int,
                  timings: dict[str, float]) -> EngineOutput:
    token_ids = [int(t) for t in choice["token_ids"]]
    lp = choice["logprobs"]
    logprobs = [float(x) for x in lp["token_logprobs"]]
    if len(logprobs) != len(token_ids):
        raise EngineError(f"vLLM returned {len(token_ids)} token ids but {len(logprobs)} logprobs")
    finish = choice.get("finish_reason")
    if finish not in ("stop", "length"):
        raise EngineError(f"vLLM finished a completion with {finish!r} (expected 'stop' or 'length')")
    reason: Literal["stop", "length"] = finish
    return EngineOutput(token_ids=token_ids, logprobs=logprobs, finish_reason=reason, top_logprobs=_top(lp, params),
                        adapter_step=step, timings=dict(timings))


def _parse_delta(choice: dict[str, Any], params: SamplingParams, step: int) -> TokenDelta | None:
    """One streamed choice chunk as a ``TokenDelta`` (None for a chunk without tokens or an end)."""
    token_ids = [int(t) for t in choice.get("token_ids") or ()]
    finish = choice.get("finish_reason")
    if not token_ids and finish is None:
        return None
    if finish not in (None, "stop", "length"):
        raise EngineError(f"vLLM finished a completion with {finish!r} (expected 'stop' or 'length')")
    lp = choice.get("logprobs") or {"token_logprobs": [], "top_logprobs": []}
    logprobs = [float(x) for x in lp["token_logprobs"]]
    if len(logprobs) != len(token_ids):
        raise EngineError(f"vLLM streamed {len(token_ids)} token ids but {len(logprobs)} logprobs")
    return TokenDelta(int(choice["index"]), token_ids, logprobs, _top(lp, params), finish, step)


def _top(logprobs: dict[str, Any], params: SamplingParams) -> list[dict[int, float]] | None:
    """Per position, the ``params.top_logprobs`` best alternatives (token id -> logprob); None when not asked."""
    if not params.top_logprobs:
        return None
    return [dict(sorted(((_token_id(k), float(v)) for k, v in position.items()),
                        key=lambda kv: -kv[1])[: params.top_logprobs]) for position in logprobs["top_logprobs"]]


def _token_id(key: str) -> int:
    # With return_tokens_as_token_ids, every token is spelled "token_id:<id>".
    return int(key.rsplit(":", 1)[1])


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except json.JSONDecodeError:
        return response.text[:500]
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            return str(error.get("message", error))
        return str(error)
    return str(body)[:500]
