"""From an HTTP request to the pipeline's input: the parsing both completion routes share.

    route (chat.py, responses.py):
        json_body(request)                       -> the body as a dict (400 for bad JSON)
        validated(Model, raw)                    -> its API's typed request (one 400 naming every bad field)
        check_served(state, model=..., ...)      -> the model name is served, the token limit kept (400, 404)
        (Responses: its request translated into the chat request that means the same)
        completion_input(chat request, ...)      -> ``completion.CompletionInput``: sampling parameters,
                                                    the messages and tools as the template and record take them
    completion.Completion(state, input)          -> render, sample, parse, record

Everything here turns what a client sent into typed values or an ``APIError`` / ``RequestValidationError``
(answered as OpenAI-shaped JSON by ``errors.py``); the pipeline never sees an HTTP body.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from ..engines.base import SamplingParams
from .completion import CompletionInput, Endpoint
from .errors import APIError
from .schemas import ChatCompletionRequest, NamedToolChoice
from .served import check_model
from .settings import GatewaySettings
from .state import GatewayState
from .tool_calls import hermes_tool_call_grammar

__all__ = ["chat_max_tokens", "check_served", "completion_input", "json_body", "new_request_id", "sampling_params", "validated"]

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


async def json_body(request: Request) -> dict[str, Any]:
    """The request body as a JSON object.

    Raises:
        APIError: 400 when it is not valid JSON, or not an object.
    """
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
    if _SURROGATE_ESCAPE.search(body) and (where := _lone_surrogate(data)) is not None:
        raise APIError(400, f"{where} holds a lone UTF-16 surrogate (half of an escaped character pair, e.g. text "
                       "cut in the middle of an emoji): send valid Unicode text", param=where, code="invalid_json")
    return data


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A surrogate written as an escape: only then can a decoded string hold a lone one (pairs decode whole)."""


def _lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path (``messages[0].content``) of the first string holding a lone surrogate, which no tokenizer,
    record or response can encode; None when there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and (found := _lone_surrogate(key, path)) is not None:
            return found
        found = _lone_surrogate(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key)
        if found is not None:
            return found
    return None


def validated(model: type[M], raw: Any, *, at: tuple[str | int, ...] = ()) -> M:
    """``raw`` as ``model``; the app turns a failure into one 400 naming every bad field.

    Args:
        model: the typed request (or part of one).
        raw: the JSON value as received.
        at: where ``raw`` sits in the body, put before each error's location (e.g. ``("body", "input", 3)``
            for an item of a Responses request's ``input``). Default: the body itself.

    Raises:
        RequestValidationError: ``raw`` does not fit ``model``; each error's ``loc`` names the field.
    """
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if at:
            errors = [{**e, "loc": (*at, *e["loc"])} for e in errors]
        raise RequestValidationError(errors) from exc


def check_served(state: GatewayState, *, model: str, max_tokens: int | None, param: str) -> None:
    """Refuse a request this gateway cannot serve as asked: the model name, then the completion's token limit.

    Args:
        state: the app's state (settings, the engine's current adapter step).
        model: the model name as requested.
        max_tokens: the completion tokens asked for (None: the gateway's default).
        param: the field ``max_tokens`` came from, as the client wrote it (named in the error).

    Raises:
        APIError: 400 for an invalid model name or a token limit above the gateway's; 404 for a model
            not served now (see ``served.check_model``).
    """
    settings = state.settings
    check_model(model, settings, state.engine.adapter_step)
    limit = settings.max_tokens_limit
    if max_tokens is not None and max_tokens > limit:
        raise APIError(
            400, f"{param} is {max_tokens}, above this gateway's limit of {limit}: ask for at most {limit}",
            param=param, code="max_tokens_too_large",
        )


def chat_max_tokens(body: ChatCompletionRequest) -> tuple[int | None, str]:
    """The completion tokens a chat request asks for, and the field that says so (``max_completion_tokens``
    wins over the deprecated ``max_tokens`` when both are given)."""
    if body.max_completion_tokens:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


def completion_input(body: ChatCompletionRequest, raw: dict[str, Any], settings: GatewaySettings, *,
                     endpoint: Endpoint, request_id: str, rollout_id: str | None, caller: str | None,
                     seed: int | None, tools: list[dict[str, Any]] | None = None,
                     max_tokens_field: str | None = None) -> CompletionInput:
    """The pipeline's input for a chat completions request already passed through ``check_served``.

    Args:
        body: the request as chat completions (the Responses route translates its request first).
        raw: the body as received (kept in the record).
        settings: the gateway's settings (token defaults).
        endpoint: the API the request came through.
        request_id: the response's id (``chatcmpl-...``, ``resp_...``).
        rollout_id: the rollout it belongs to, if any.
        caller: the ``X-Art-Caller`` label, if any.
        seed: the ``X-Art-Seed`` header's seed, used when the body names no ``seed``.
        tools: the chat-format tool schemas as sent. Default: ``raw["tools"]``.
        max_tokens_field: the request's name for the completion length, named in errors (the Responses API's
            ``max_output_tokens``). Default: the chat request's field that set it.
    """
    if body.model_extra:
        logger.debug("ignoring unknown request fields: %s", sorted(body.model_extra))
    params = sampling_params(body, settings, seed=seed)
    asked, param = chat_max_tokens(body)
    # The template sees the tools unless tool_choice is "none"; then no calls are parsed either.
    offered = bool(body.tools) and body.tool_choice != "none"
    return CompletionInput(
        endpoint=endpoint, request_id=request_id, model=body.model,
        messages=[m.model_dump(exclude_none=True) for m in body.messages],  # dumped once: template and record
        tools=(tools if tools is not None else raw["tools"]) if offered else None,
        tool_names=[t.function.name for t in body.tools or []] if offered else None,
        params=params, top_logprobs=body.top_logprobs or 0 if body.logprobs else -1, raw=raw,
        rollout_id=rollout_id, caller=caller,
        max_tokens_param=(max_tokens_field or param) if asked is not None else None,
    )


def sampling_params(body: ChatCompletionRequest, settings: GatewaySettings, *,
                    seed: int | None = None) -> SamplingParams:
    """The engine's sampling parameters for a chat request (its token limit already checked by ``check_served``).

    Args:
        body: the request.
        settings: the gateway's settings (the default and largest completion lengths).
        seed: the seed to sample with when the body names none (the ``X-Art-Seed`` header). Default: None.
    """
    asked, _ = chat_max_tokens(body)
    json_schema, grammar = None, None
    one_or_more = body.parallel_tool_calls is not False  # False: at most one call, as OpenAI's models honour it
    if body.tools and (body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice)):
        # Enforced by constrained decoding: the completion is Hermes tool-call blocks, as the template teaches. A
        # response_format beside it shapes a later text reply, not this one (OpenAI accepts the pair: the Agents SDK
        # sends it for an agent with an output_type and tool_choice="required", resetting the choice after the call).
        tools = [(t.function.name, t.function.parameters) for t in body.tools]
        if isinstance(body.tool_choice, NamedToolChoice):
            tools = [t for t in tools if t[0] == body.tool_choice.function.name]
        grammar = hermes_tool_call_grammar(tools, multiple=body.tool_choice == "required" and one_or_more)
    elif body.response_format is not None and body.response_format.type == "json_object":
        json_schema = {"type": "object"}  # "any JSON object": engines that constrain output get the same rule
    elif body.response_format is not None and body.response_format.json_schema is not None:
        json_schema = body.response_format.json_schema.schema_
    if json_schema is not None and body.tools and body.tool_choice != "none":
        # Tools offered with tool_choice "auto" and a response_format: the reply is tool calls or the structured
        # answer. Constraining it to the schema alone would leave the tools uncallable.
        tools = [(t.function.name, t.function.parameters) for t in body.tools]
        json_schema, grammar = None, hermes_tool_call_grammar(tools, multiple=one_or_more, or_json=json_schema)
    return SamplingParams(
        max_tokens=asked if asked is not None else min(settings.default_max_tokens, settings.max_tokens_limit),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        stop=body.stop_strings(),
        seed=body.seed if body.seed is not None else seed,
        n=body.n or 1,
        top_logprobs=body.top_logprobs or 0,
        json_schema=json_schema,
        grammar=grammar,
    )


def new_request_id(prefix: str) -> str:
    """A fresh response id: ``prefix`` and 32 random hex digits."""
    return prefix + os.urandom(16).hex()  # as random as uuid4().hex, without building a UUID
