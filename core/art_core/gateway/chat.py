"""``POST /v1/chat/completions``: render, generate, parse tool calls, record, answer.

One request, top to bottom:

    body -> validated request -> model name checked -> prompt ids (chat template) -> engine.generate
         -> per choice: decode, parse tool calls, record (flushed to disk) -> JSON or SSE response

The response is exactly what the client asked for: logprobs only when requested, one choice per ``n``.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from ..engines.base import EngineOutput, SamplingParams
from ..errors import ConstraintError, LifecycleError
from .errors import APIError
from .records import ExchangeRecord
from .schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    NamedToolChoice,
    FunctionCallOut,
    ResponseMessage,
    TokenLogprob,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from .served import check_model
from .state import GatewayState, call_headers, request_scope
from .streaming import StreamedChoice, sse_chunks
from .tokens import Detokenizer, render_prompt, template_message
from .tool_calls import ParsedToolCall, format_tool_call_id, hermes_tool_call_grammar, parse_tool_calls

__all__ = ["router"]

logger = logging.getLogger(__name__)

router = APIRouter()


@dataclass(frozen=True)
class _Answer:
    """One choice, decoded and parsed."""

    text: str
    """Decoded completion (special tokens dropped, stop string cut): what content deltas add up to."""
    content: str | None
    tool_calls: list[ParsedToolCall]
    finish_reason: str
    parse_errors: int


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    """OpenAI's chat completions, served by the engine and recorded token-exactly."""
    state, rollout_id, caller = request_scope(request)  # plain calls, not Depends: see request_scope
    started = time.perf_counter()
    created = time.time()
    raw = await _json_object(request)
    body = _validate(raw)
    if body.model_extra:
        logger.debug("ignoring unknown request fields: %s", sorted(body.model_extra))
    check_model(body.model, state.settings, state.engine.adapter_step)
    params = _sampling_params(body, state)

    # --- prompt: the template sees the tools unless tool_choice is "none" ---
    offer_tools = bool(body.tools) and body.tool_choice != "none"
    tool_names = [t.function.name for t in body.tools or []] if offer_tools else None
    chat_messages = [m.model_dump(exclude_none=True) for m in body.messages]  # dumped once: template and record
    prompt_ids = render_prompt(state.engine.tokenizer, [template_message(m) for m in chat_messages],
                               raw["tools"] if offer_tools else None)

    # --- generate (held here while the gateway is paused for training) ---
    outputs, waited = await generate_outputs(state, prompt_ids, params)

    # --- per choice: decode, parse, record (on disk before the client hears back) ---
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    answers = [_answer(out, state.detokenizer, params.stop, tool_names) for out in outputs]
    replies = [_message(answer) for answer in answers]
    for index, (out, answer, reply) in enumerate(zip(outputs, answers, replies, strict=True)):
        state.records.add(ExchangeRecord(
            request_id=request_id, choice_index=index, rollout_id=rollout_id, created=created, model=body.model,
            adapter_step=out.adapter_step, request=raw, prompt_token_ids=prompt_ids,
            completion_token_ids=list(out.token_ids), logprobs=list(out.logprobs), finish_reason=answer.finish_reason,
            timings={"wait": waited, **out.timings, "total": time.perf_counter() - started},
            messages=chat_messages, tools=raw["tools"] if offer_tools else [],
            reply=reply.model_dump(exclude_none=True), caller=caller,
        ))
    metrics = state.metrics
    metrics.completions += 1
    metrics.records_written += len(outputs)
    metrics.prompt_tokens += len(prompt_ids)
    metrics.completion_tokens += sum(len(out.token_ids) for out in outputs)
    metrics.tool_call_parse_errors += sum(a.parse_errors for a in answers)
    metrics.tool_calls += sum(len(a.tool_calls) for a in answers)

    # --- answer ---
    usage = Usage(prompt_tokens=len(prompt_ids), completion_tokens=sum(len(o.token_ids) for o in outputs),
                  total_tokens=len(prompt_ids) + sum(len(o.token_ids) for o in outputs))
    fingerprint = f"adapter-{outputs[0].adapter_step}"
    headers = call_headers(request_id, outputs[0].adapter_step, usage.prompt_tokens, usage.completion_tokens)
    top_n = body.top_logprobs or 0
    logprobs = [_logprob_entries(out, state.detokenizer, top_n) if body.logprobs else None for out in outputs]
    if body.stream:
        header = {"id": request_id, "object": "chat.completion.chunk", "created": int(created), "model": body.model,
                  "system_fingerprint": fingerprint}
        streamed = [
            StreamedChoice(index=i, token_ids=list(out.token_ids), text=a.text, finish_reason=a.finish_reason,
                           logprobs=[e.model_dump() for e in lp] if lp is not None else None, tool_names=tool_names,
                           tool_call_ids=[call.id for call in reply.tool_calls or []])
            for i, (out, a, lp, reply) in enumerate(zip(outputs, answers, logprobs, replies, strict=True))
        ]
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = sse_chunks(streamed, detokenizer=state.detokenizer, header=header,
                            usage=usage.model_dump() if include_usage else None)
        return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
    completion = ChatCompletion(
        id=request_id, created=int(created), model=body.model, usage=usage, system_fingerprint=fingerprint,
        choices=[
            Choice(index=i, message=reply, finish_reason=a.finish_reason,  # type: ignore[arg-type]
                   logprobs=ChoiceLogprobs(content=lp) if lp is not None else None)
            for i, (a, lp, reply) in enumerate(zip(answers, logprobs, replies, strict=True))
        ],
    )
    # Serialised once, by pydantic's Rust serialiser (not model_dump() and then json.dumps again).
    return Response(completion.model_dump_json(), media_type="application/json", headers=headers)


async def generate_outputs(
    state: GatewayState, prompt_ids: list[int], params: SamplingParams
) -> tuple[list[EngineOutput], float]:
    """``engine.generate`` for an endpoint: held while paused, failures mapped to 503/500, outputs checked.

    Returns:
        The outputs and the seconds the request waited for a training step to finish.
    """
    try:
        async with state.control.admitted() as waited:
            outputs = await state.engine.generate(prompt_ids, params)
    except APIError:
        raise
    except ConstraintError as exc:
        raise APIError(400, f"{exc}: send a JSON schema (response_format, tool parameters) this engine can enforce",
                       param="response_format" if params.grammar is None else "tools",
                       code="unsupported_schema") from exc
    except LifecycleError as exc:
        logger.warning("engine unavailable: %s", exc)
        raise APIError(503, f"the engine is not available: {exc}", code="engine_unavailable") from exc
    except Exception as exc:
        logger.exception("engine.generate failed")
        raise APIError(500, f"the engine failed: {type(exc).__name__}: {exc}", code="engine_error") from exc
    _check_outputs(outputs, params.n)
    return outputs, waited


async def _json_object(request: Request) -> dict[str, Any]:
    body = await request.body()
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise APIError(
            400, f"the request body is not valid JSON ({exc}): send a JSON object with Content-Type: application/json",
            code="invalid_json",
        ) from exc
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    return data


def _validate(raw: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(raw)
    except ValidationError as exc:
        # The app's handler turns this into one 400 that names every bad field.
        raise RequestValidationError(exc.errors(include_url=False)) from exc


def _sampling_params(body: ChatCompletionRequest, state: GatewayState) -> SamplingParams:
    limit = state.settings.max_tokens_limit
    asked, field = (body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens else (
        body.max_tokens, "max_tokens")
    if asked is not None and asked > limit:
        raise APIError(
            400, f"{field} is {asked}, above this gateway's limit of {limit}: ask for at most {limit}",
            param=field, code="max_tokens_too_large",
        )
    json_schema, grammar = None, None
    if body.tools and (body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice)):
        if body.response_format is not None and body.response_format.type != "text":
            raise APIError(400, "tool_choice 'required' or a named function cannot be combined with response_format "
                           f"{body.response_format.type!r}: the reply is a tool call; drop one of the two",
                           param="tool_choice", code="invalid_request")
        # Enforced by constrained decoding: the completion is Hermes tool-call blocks, as the template teaches.
        tools = [(t.function.name, t.function.parameters) for t in body.tools]
        if isinstance(body.tool_choice, NamedToolChoice):
            tools = [t for t in tools if t[0] == body.tool_choice.function.name]
        grammar = hermes_tool_call_grammar(tools, multiple=body.tool_choice == "required")
    elif body.response_format is not None and body.response_format.type == "json_object":
        json_schema = {"type": "object"}  # "any JSON object": engines that constrain output get the same rule
    elif body.response_format is not None and body.response_format.json_schema is not None:
        json_schema = body.response_format.json_schema.schema_
    return SamplingParams(
        max_tokens=asked if asked is not None else min(state.settings.default_max_tokens, limit),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        stop=body.stop_strings(),
        seed=body.seed,
        n=body.n or 1,
        top_logprobs=body.top_logprobs or 0,
        json_schema=json_schema,
        grammar=grammar,
    )


def _check_outputs(outputs: list[EngineOutput], n: int) -> None:
    """The engine keeps its contract, or the request fails loudly (a bad record would poison training)."""
    problem = None
    if len(outputs) != n:
        problem = f"returned {len(outputs)} completions for n={n}"
    for i, out in enumerate(outputs):
        if len(out.logprobs) != len(out.token_ids):
            problem = f"completion {i} has {len(out.token_ids)} tokens but {len(out.logprobs)} logprobs"
    if problem is not None:
        logger.error("engine broke its contract: %s", problem)
        raise APIError(500, f"the engine {problem}", code="engine_error")


def _answer(
    out: EngineOutput, detokenizer: Detokenizer, stop: tuple[str, ...], tool_names: list[str] | None
) -> _Answer:
    text = detokenizer.decode(list(out.token_ids))
    finish: str = out.finish_reason
    # The engine should stop on stop strings itself; cutting here keeps OpenAI's contract if it did not.
    cuts = [text.find(s) for s in stop if s in text]
    if cuts:
        text, finish = text[: min(cuts)], "stop"
    if tool_names is None:  # no tools offered: the text is all content, verbatim
        return _Answer(text, text, [], finish, 0)
    parsed = parse_tool_calls(text, tool_names=tool_names)
    if parsed.tool_calls and finish != "length":  # a cut-off completion still says "length"
        finish = "tool_calls"
    return _Answer(text, parsed.content, parsed.tool_calls, finish, parsed.parse_errors)


def _message(answer: _Answer) -> ResponseMessage:
    calls = [
        ToolCallOut(id=format_tool_call_id(), function=FunctionCallOut(name=c.name, arguments=c.arguments))
        for c in answer.tool_calls
    ]
    return ResponseMessage(content=answer.content, tool_calls=calls or None)


def _logprob_entries(out: EngineOutput, detokenizer: Detokenizer, top_n: int) -> list[TokenLogprob]:
    """OpenAI's per-token logprobs for the tokens of the text (special tokens such as end-of-turn left out)."""
    entries = []
    for pos, (token_id, logprob) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        if token_id in detokenizer.skip_ids:
            continue
        top: list[TopLogprob] = []
        if top_n and out.top_logprobs is not None and pos < len(out.top_logprobs):
            best = sorted(out.top_logprobs[pos].items(), key=lambda kv: kv[1], reverse=True)[:top_n]
            top = [_top(tid, lp, detokenizer) for tid, lp in best]
        raw = detokenizer.token_bytes(token_id)
        entries.append(TokenLogprob(token=raw.decode("utf-8", errors="replace"), logprob=_finite(logprob),
                                    bytes=list(raw), top_logprobs=top))
    return entries


def _top(token_id: int, logprob: float, detokenizer: Detokenizer) -> TopLogprob:
    raw = detokenizer.token_bytes(token_id)
    return TopLogprob(token=raw.decode("utf-8", errors="replace"), logprob=_finite(logprob), bytes=list(raw))


def _finite(logprob: float) -> float:
    # JSON has no -Infinity; OpenAI reports "practically impossible" as -9999.0. Records keep the raw value.
    return logprob if math.isfinite(logprob) else -9999.0
