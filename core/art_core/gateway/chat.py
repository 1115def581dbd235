"""``POST /v1/chat/completions``: OpenAI's chat completions API over the completion pipeline.

This module only translates: the request is parsed as chat completions (``parsing``: validated, model
name and token limit checked) and handed to ``completion.Completion`` (render, sample, parse tool calls,
record); its events come back as a
``ChatCompletion`` object (``schemas.ChatCompletion``), or as ``chat.completion.chunk`` events sent as the tokens are sampled. The
response is exactly what the client asked for: logprobs only when requested, one choice per ``n``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .completion import Answer, Completion, Done, TextDelta, ToolCallDelta
from .parsing import chat_max_tokens, check_served, completion_input, json_body, new_request_id, validated
from .schemas import ChatCompletionRequest, TokenLogprob, Usage
from .state import call_headers, request_scope, request_seed
from .streaming import ClientGone, open_stream, sse, until_done

__all__ = ["router"]

router = APIRouter()


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    """OpenAI's chat completions, served by the engine and recorded token-exactly."""
    state, rollout_id, caller = request_scope(request)  # plain calls, not Depends: see request_scope
    raw = await json_body(request)
    body = validated(ChatCompletionRequest, raw)
    max_tokens, param = chat_max_tokens(body)
    check_served(state, model=body.model, max_tokens=max_tokens, param=param)
    completion = Completion(state, completion_input(
        body, raw, state.settings, endpoint="chat.completions", request_id=new_request_id("chatcmpl-"),
        rollout_id=rollout_id, caller=caller, seed=request_seed(request)))
    try:
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await open_stream(request, completion.events(),
                                     lambda events: _chunks(completion, events, include_usage=include_usage),
                                     lambda: call_headers(completion.input.request_id, state.engine.adapter_step,
                                                          len(completion.prompt_ids), None))
        answers = await until_done(request, completion.answers())
    except ClientGone:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    usage = _usage(completion, answers)
    headers = call_headers(completion.input.request_id, answers[0].adapter_step, usage.prompt_tokens, usage.completion_tokens)
    return Response(_completion_json(completion, answers, usage), media_type="application/json", headers=headers)


def _completion_json(completion: Completion, answers: list[Answer], usage: Usage) -> bytes:
    """The ``ChatCompletion`` object as JSON, every field in the model's order (a test checks it against the model).

    Built as plain dicts from values the pipeline made and typed itself, and serialised once: the typed
    models' construction cost more than the rest of the response (benchmark part (c)).
    """
    result = {
        "id": completion.input.request_id, "object": "chat.completion", "created": int(completion.created),
        "model": completion.input.model,
        "choices": [{"index": a.index, "message": _message(a), "finish_reason": a.finish_reason,
                     "logprobs": {"content": [e.model_dump() for e in a.logprobs], "refusal": None}
                     if a.logprobs is not None else None} for a in answers],
        "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                  "total_tokens": usage.total_tokens},
        "system_fingerprint": f"adapter-{answers[0].adapter_step}",
    }
    return json.dumps(result, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


async def _chunks(completion: Completion, events: AsyncIterator[TextDelta | ToolCallDelta | Done], *,
                  include_usage: bool) -> AsyncIterator[bytes]:
    """The events as ``chat.completion.chunk`` SSE: a role chunk per choice, deltas, a finish chunk per
    choice, the usage chunk (when asked for), then ``[DONE]``."""
    header = {"id": completion.input.request_id, "object": "chat.completion.chunk", "created": int(completion.created),
              "model": completion.input.model, "system_fingerprint": f"adapter-{completion.state.engine.adapter_step}"}
    if include_usage:  # OpenAI: "All other chunks will also include a usage field, but with a null value."
        header["usage"] = None

    def chunk(index: int, delta: dict[str, Any], logprobs: list[TokenLogprob] | None,
              finish: str | None = None) -> bytes:
        entries = {"content": [e.model_dump() for e in logprobs], "refusal": None} if logprobs is not None else None
        return sse({**header, "choices": [{"index": index, "delta": delta, "finish_reason": finish,
                                           "logprobs": entries}]})

    for index in range(completion.input.params.n):
        yield chunk(index, {"role": "assistant", "content": ""}, None)
    answers = []
    async for event in events:
        if isinstance(event, TextDelta):
            yield chunk(event.index, {"content": event.text}, event.logprobs)
        elif isinstance(event, ToolCallDelta):  # OpenAI sends the id and name first, then the arguments
            call = event.call
            yield chunk(event.index, {"tool_calls": [{"index": event.call_index, "id": call.id, "type": "function",
                                                      "function": {"name": call.function.name, "arguments": ""}}]},
                        event.logprobs)
            yield chunk(event.index, {"tool_calls": [{"index": event.call_index,
                                                      "function": {"arguments": call.function.arguments}}]},
                        [] if event.logprobs is not None else None)
        else:
            answers.append(event.answer)
            tail = event.logprobs if event.logprobs else None
            yield chunk(event.answer.index, {}, tail, finish=event.answer.finish_reason)
    if include_usage:
        yield sse({**header, "choices": [], "usage": _usage(completion, answers).model_dump()})
    yield sse("[DONE]")


def _usage(completion: Completion, answers: list[Answer]) -> Usage:
    prompt, generated = len(completion.prompt_ids), sum(a.completion_tokens for a in answers)
    return Usage.model_construct(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated)


def _message(answer: Answer) -> dict[str, Any]:
    """``ResponseMessage`` as a dict, in its field order."""
    calls = [c.model_dump() for c in answer.tool_calls] if answer.tool_calls else None
    return {"role": "assistant", "content": answer.content, "tool_calls": calls, "refusal": None}
