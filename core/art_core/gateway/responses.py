"""``POST /v1/responses``: OpenAI's Responses API (the OpenAI Agents SDK's default), over chat.py's pipeline.

A Responses request is translated into the chat completions request that means the same, and then takes
chat.py's road: the same validation, sampling parameters, chat template, engine call, tool-call parsing
and record. Only the two ends differ:

    body -> stateless checks -> input items -> chat messages (+ tools, text.format, max_output_tokens)
         -> ChatCompletionRequest -> prompt ids -> engine.generate -> decode, parse tool calls
         -> record (endpoint "responses") -> a Response object, or its SSE events

Translation:

- ``instructions`` is a system message, first;
- ``message`` items (roles user, system, developer, assistant; ``type`` may be left out) keep their role.
  Text parts (``input_text``, ``output_text``, ``refusal``) join into one string; other parts (images,
  files) reach the chat template, which refuses them for a text-only model (422);
- ``function_call`` items join the assistant message just before them, or start one: the calls a turn made,
  and the text it wrote before them, are one assistant message, as the model produced them;
- ``function_call_output`` items are ``tool`` messages; their ``call_id`` must name an earlier call.

The gateway stores nothing between requests: ``previous_response_id``, ``conversation``, ``prompt`` and
``background`` are refused with 400, and the full conversation goes in ``input`` (the Agents SDK sends it
that way by default). ``store``, ``reasoning``, ``truncation``, ``metadata`` and unknown fields are accepted
and ignored (``metadata`` and ``truncation`` are echoed back).

A completion cut at ``max_output_tokens`` answers ``status: "incomplete"`` with
``incomplete_details.reason: "max_output_tokens"`` (streamed: a ``response.incomplete`` event), as OpenAI
does; the Agents SDK raises ``ModelBehaviorError`` on it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..engines.base import EngineOutput, SamplingParams
from .chat import _Answer, _answer, _json_object, _logprob_entries, _sampling_params, generate_outputs
from .chat import _validate as _validate_chat
from .errors import APIError
from .records import ExchangeRecord
from .schemas import ChatCompletionRequest, FunctionDefinition, JsonSchemaFormat, TokenLogprob
from .served import check_model
from .state import GatewayState, call_headers, request_scope
from .streaming import _sse
from .tokens import Detokenizer, render_prompt, template_message
from .tool_calls import ContentDelta, ToolCallStream, format_tool_call_id

__all__ = ["ResponseObject", "ResponsesRequest", "router"]

logger = logging.getLogger(__name__)

router = APIRouter()

_LOGPROBS = "message.output_text.logprobs"
"""The ``include`` value that asks for per-token logprobs in ``output_text`` parts."""

# Request fields that only make sense with state kept on the server, and what to do instead.
_STATEFUL = {
    "previous_response_id": "send the whole conversation in input instead (the Agents SDK does, unless you "
                            "pass previous_response_id)",
    "conversation": "send the whole conversation in input instead (the Agents SDK does, unless you pass "
                    "conversation_id)",
    "prompt": "stored prompt templates live on OpenAI's servers: send instructions and input instead",
}
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}  # part type -> its text field


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


# --- request --------------------------------------------------------------------------------------


class ContentPart(_Loose):
    type: str
    """``input_text``, ``output_text`` or ``refusal`` are text; others reach the chat template (which may refuse)."""
    text: str | None = None
    refusal: str | None = None


class MessageItem(_Loose):
    """A turn of the conversation; ``type`` may be left out (OpenAI's "easy input message")."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]


class FunctionCallItem(_Loose):
    """A call the model made (as a previous response returned it)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    """JSON text of the arguments object."""


class FunctionCallOutputItem(_Loose):
    """A tool's result, answering the call with the same ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
_ITEM_MODELS: dict[str, type[InputItem]] = {
    "message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem}
"""The item types ``input`` may hold, by their ``type``."""


class FunctionTool(FunctionDefinition):
    """A function the model may call: chat's function definition, flattened (name and schema are checked the same)."""

    type: Literal["function"]


class NamedFunctionChoice(_Loose):
    type: Literal["function"]
    name: str


class TextFormat(JsonSchemaFormat):
    """``text.format``: plain text, any JSON object, or JSON following ``schema`` (passed to the engine)."""

    type: Literal["text", "json_object", "json_schema"]

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError('type "json_schema" needs name and schema: the JSON Schema the answer must follow')
        return self


class TextConfig(_Loose):
    format: TextFormat | None = None
    """Default: plain text. (``verbosity`` is accepted and ignored.)"""


class ResponsesRequest(_Loose):
    """``POST /v1/responses``. Field meanings follow OpenAI's API reference; ``input`` is checked item by item."""

    model: str = Field(min_length=1)
    input: str | list[Any]
    """A user message's text, or the conversation as items (checked one by one: see ``_input_item``)."""
    instructions: str | None = None
    """A system message before ``input``."""
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    """As chat's: ``none`` hides the tools and parses no calls; the others are accepted, not enforced."""
    parallel_tool_calls: bool | None = None
    """Accepted; the model may write several calls either way."""
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    """Alternatives per token, returned when ``include`` has ``message.output_text.logprobs``."""
    include: list[str] | None = None
    """Only ``message.output_text.logprobs`` has an effect; other values are ignored."""
    text: TextConfig | None = None
    stream: bool | None = None
    metadata: dict[str, str] | None = None
    """Echoed back."""
    truncation: Literal["auto", "disabled"] | None = None
    """Echoed back; a prompt over the context is a 400 either way."""

    @field_validator("input", mode="before")
    @classmethod
    def _text_or_items(cls, value: Any) -> Any:
        if not isinstance(value, (str, list)):  # checked here so the error does not list both union branches
            raise ValueError(f"input must be a string or a list of items, got {type(value).__name__}")
        return value


# --- response -------------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprob] = Field(default_factory=list)
    """Every visible token of the completion (tool-call markup included, as chat returns them) when ``include``
    asks for them; else empty."""


class OutputMessage(BaseModel):
    id: str
    """``msg_...``"""
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    """``fc_...``: the item's id."""
    type: Literal["function_call"] = "function_call"
    call_id: str
    """``call_...``: what the ``function_call_output`` answering it names."""
    name: str
    arguments: str
    """JSON text of the arguments object."""
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int] = Field(
        default_factory=lambda: {"cached_tokens": 0, "cache_write_tokens": 0})  # no prompt cache
    output_tokens: int
    """Completion tokens, the end-of-turn token included."""
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int


class ResponseObject(BaseModel):
    """OpenAI's ``Response``, with the request's settings echoed as the API does."""

    id: str
    """``resp_...``; also the record's ``request_id``."""
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: dict[str, str] | None = None
    """``{"reason": "max_output_tokens"}`` when the completion was cut."""
    model: str
    """The model name as requested."""
    output: list[OutputMessage | OutputFunctionCall]
    """The message (if the model wrote text, or wrote nothing at all), then the function calls."""
    usage: ResponseUsage | None
    instructions: str | None
    metadata: dict[str, str]
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    max_output_tokens: int | None
    top_logprobs: int
    text: dict[str, Any]
    truncation: str
    previous_response_id: None = None
    reasoning: None = None
    background: bool = False
    store: bool = False
    """Nothing is stored: the gateway is stateless."""


# --- the route ------------------------------------------------------------------------------------


@router.post("/responses")
async def create_response(request: Request) -> Response:
    """OpenAI's Responses API, served by the engine and recorded token-exactly."""
    state, rollout_id, caller = request_scope(request)  # plain calls, not Depends: see request_scope
    started = time.perf_counter()
    created = time.time()
    raw = await _json_object(request)
    _refuse_unsupported(raw)
    body, items = _validate(raw)
    if body.model_extra:
        logger.debug("ignoring unknown or unused request fields: %s", sorted(body.model_extra))
    check_model(body.model, state.settings, state.engine.adapter_step)
    limit = state.settings.max_tokens_limit
    if body.max_output_tokens is not None and body.max_output_tokens > limit:
        raise APIError(
            400, f"max_output_tokens is {body.max_output_tokens}, above this gateway's limit of {limit}: ask for at "
            f"most {limit}", param="max_output_tokens", code="max_tokens_too_large",
        )

    # --- the equivalent chat request: from here on, chat.py's helpers do the work ---
    chat_tools = [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
                  for tool in raw.get("tools") or []]
    chat = _as_chat_request(body, _chat_messages(body.instructions, items), chat_tools)
    params = _sampling_params(chat, state)
    offer_tools = bool(chat.tools) and chat.tool_choice != "none"
    tool_names = [t.function.name for t in chat.tools or []] if offer_tools else None
    chat_messages = [m.model_dump(exclude_none=True) for m in chat.messages]  # dumped once: template and record
    prompt_ids = render_prompt(state.engine.tokenizer, [template_message(m) for m in chat_messages],
                               chat_tools if offer_tools else None)

    # --- generate, check, decode and parse, record (on disk before the client hears back) ---
    outputs, waited = await generate_outputs(state, prompt_ids, params)
    (out,) = outputs
    answer = _answer(out, state.detokenizer, params.stop, tool_names)
    response_id = f"resp_{uuid.uuid4().hex}"
    call_ids = [format_tool_call_id() for _ in answer.tool_calls]
    reply: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if call_ids:
        reply["tool_calls"] = [{"id": call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for call_id, c in zip(call_ids, answer.tool_calls, strict=True)]
    state.records.add(ExchangeRecord(
        request_id=response_id, rollout_id=rollout_id, created=created, endpoint="responses", model=body.model,
        adapter_step=out.adapter_step, request=raw, prompt_token_ids=prompt_ids,
        completion_token_ids=list(out.token_ids), logprobs=list(out.logprobs), finish_reason=answer.finish_reason,
        timings={"wait": waited, **out.timings, "total": time.perf_counter() - started},
        messages=chat_messages, tools=chat_tools if offer_tools else [],
        reply={k: v for k, v in reply.items() if v is not None}, caller=caller,
    ))
    metrics = state.metrics
    metrics.completions += 1
    metrics.records_written += 1
    metrics.prompt_tokens += len(prompt_ids)
    metrics.completion_tokens += len(out.token_ids)
    metrics.tool_call_parse_errors += answer.parse_errors
    metrics.tool_calls += len(answer.tool_calls)

    # --- answer ---
    want_logprobs = _LOGPROBS in (body.include or ())
    logprobs = _logprob_entries(out, state.detokenizer, body.top_logprobs or 0) if want_logprobs else []
    response = _response_object(body, raw, response_id=response_id, created=created, answer=answer, call_ids=call_ids,
                                logprobs=logprobs, params=params, usage=(len(prompt_ids), len(out.token_ids)))
    headers = call_headers(response_id, out.adapter_step, len(prompt_ids), len(out.token_ids))
    if body.stream:
        deltas = _content_deltas(out, answer.text, answer.content, state.detokenizer, tool_names, logprobs)
        return StreamingResponse(_sse_events(response, deltas), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **headers})
    return JSONResponse(response.model_dump(mode="json"), headers=headers)


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    """400 for what a stateless gateway serving one function-calling model cannot do, saying what to do instead."""
    for field, instead in _STATEFUL.items():
        if raw.get(field) is not None:
            raise APIError(400, f"{field} is not supported: this gateway is stateless and stores no responses or "
                           f"conversations; {instead}", param=field, code="unsupported_parameter")
    if raw.get("background"):
        raise APIError(400, "background responses are not supported: this gateway is stateless; omit background "
                       "and wait for the response (or stream it)", param="background", code="unsupported_parameter")
    for i, tool in enumerate(raw.get("tools") or []):
        if isinstance(tool, dict) and tool.get("type") != "function":
            raise APIError(400, f"tools[{i}] has type {tool.get('type')!r}: this gateway serves the model being "
                           "trained, which can call only your own functions; use tools of type \"function\"",
                           param=f"tools[{i}].type", code="unsupported_tool_type")


def _validate(raw: dict[str, Any]) -> tuple[ResponsesRequest, list[InputItem]]:
    """The request and its ``input`` as typed items (a string is one user message)."""
    try:
        body = ResponsesRequest.model_validate(raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from exc  # one 400 naming every bad field
    if isinstance(body.input, str):
        return body, [MessageItem(role="user", content=body.input)]
    if not body.input:
        raise APIError(400, "input is an empty list: send at least one item, or a string", param="input",
                       code="invalid_value")
    return body, [_input_item(i, item) for i, item in enumerate(body.input)]


def _input_item(index: int, item: Any) -> InputItem:
    """One ``input`` item as its typed model; the item's type picks the model (a bare ``role`` means a message)."""
    if not isinstance(item, dict):
        raise APIError(400, f"input[{index}] is a {type(item).__name__}: each input item must be a JSON object",
                       param=f"input[{index}]", code="invalid_value")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "item_reference":
        raise APIError(400, f"input[{index}] is an item_reference: this gateway is stateless and stores no items; "
                       "send the item itself", param=f"input[{index}]", code="unsupported_item_type")
    if kind not in _ITEM_MODELS:
        raise APIError(
            400, f"input[{index}] has type {kind!r}: this gateway accepts {', '.join(_ITEM_MODELS)} items "
            "(a message may leave out type but needs a role)", param=f"input[{index}].type",
            code="unsupported_item_type",
        )
    try:
        return _ITEM_MODELS[kind].model_validate(item)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", "input", index, *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from exc


def _chat_messages(instructions: str | None, items: list[InputItem]) -> list[dict[str, Any]]:
    """The conversation as chat messages (see the module docstring for the rules)."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    calls: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            calls.add(item.call_id)
            if messages and messages[-1]["role"] == "assistant":  # the same turn: its text, then its calls
                messages[-1]["tool_calls"] = [*(messages[-1].get("tool_calls") or []), call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise APIError(400, f"input[{i}] is the output of call {item.call_id!r}, but no function_call item "
                               "before it has that call_id: send the call too", param=f"input[{i}].call_id",
                               code="invalid_value")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _content(item.output)})
        else:
            messages.append({"role": item.role, "content": _content(item.content)})
    return messages


def _content(content: str | list[ContentPart]) -> str | list[dict[str, Any]]:
    """Text parts as one string; with other parts, chat-style parts for the template to take or refuse."""
    if isinstance(content, str):
        return content
    if all(part.type in _TEXT_PARTS for part in content):
        return "".join(getattr(part, _TEXT_PARTS[part.type]) or "" for part in content)
    return [{"type": "text", "text": getattr(part, _TEXT_PARTS[part.type]) or ""} if part.type in _TEXT_PARTS
            else part.model_dump(exclude_none=True) for part in content]


def _as_chat_request(
    body: ResponsesRequest, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat completions request that asks for the same completion (checked like one, e.g. unique tool names)."""
    choice = body.tool_choice
    fmt = body.text.format if body.text is not None else None
    logprobs = _LOGPROBS in (body.include or ())
    return _validate_chat({
        "model": body.model,
        "messages": messages,
        "tools": tools or None,
        "tool_choice": {"type": "function", "function": {"name": choice.name}} if isinstance(
            choice, NamedFunctionChoice) else choice,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_completion_tokens": body.max_output_tokens,
        "logprobs": logprobs,
        "top_logprobs": body.top_logprobs if logprobs else None,
        "response_format": None if fmt is None else {"type": fmt.type, "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict} if fmt.type == "json_schema" else None},
    })


def _response_object(
    body: ResponsesRequest, raw: dict[str, Any], *, response_id: str, created: float, answer: _Answer,
    call_ids: list[str], logprobs: list[TokenLogprob], params: SamplingParams, usage: tuple[int, int],
) -> ResponseObject:
    """The Response: a message when the model wrote text (or nothing at all), then its calls, plus the echoes."""
    incomplete = answer.finish_reason == "length"
    output: list[OutputMessage | OutputFunctionCall] = []
    if answer.content is not None:  # None only when the model called tools and wrote no text
        output.append(OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="incomplete" if incomplete else "completed",
                                    content=[OutputText(text=answer.content, logprobs=logprobs)]))
    output += [OutputFunctionCall(id=f"fc_{uuid.uuid4().hex}", call_id=call_id, name=call.name,
                                  arguments=call.arguments) for call_id, call in zip(call_ids, answer.tool_calls, strict=True)]
    prompt_tokens, completion_tokens = usage
    text = raw.get("text") or {}
    return ResponseObject(
        id=response_id, created_at=int(created), status="incomplete" if incomplete else "completed",
        incomplete_details={"reason": "max_output_tokens"} if incomplete else None, model=body.model, output=output,
        usage=ResponseUsage(input_tokens=prompt_tokens, output_tokens=completion_tokens,
                            total_tokens=prompt_tokens + completion_tokens),
        instructions=body.instructions, metadata=body.metadata or {}, tools=raw.get("tools") or [],
        tool_choice=raw.get("tool_choice") or "auto",
        parallel_tool_calls=True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        temperature=params.temperature, top_p=params.top_p, max_output_tokens=body.max_output_tokens,
        top_logprobs=body.top_logprobs or 0, text={**text, "format": text.get("format") or {"type": "text"}},
        truncation=body.truncation or "disabled",
    )


# --- streaming ------------------------------------------------------------------------------------


def _content_deltas(
    out: EngineOutput, text: str, content: str | None, detokenizer: Detokenizer, tool_names: list[str] | None,
    logprobs: list[TokenLogprob],
) -> list[tuple[str, list[TokenLogprob]]]:
    """The message text split as the tokens produce it, each piece with its tokens' logprob entries.

    Tool-call markup is left out the way ``streaming.py`` does it (``ToolCallStream``), so the pieces add up
    to ``content``; tokens that produced no content (markup) carry their entries in the next piece.
    """
    if content is None:
        return []
    parser = ToolCallStream(tool_names=tool_names) if tool_names is not None else None
    deltas: list[tuple[str, list[TokenLogprob]]] = []
    pending: list[TokenLogprob] = []
    used = 0
    for piece, count in detokenizer.text_pieces(list(out.token_ids), text):
        pending += logprobs[used : used + count]
        used += count
        events = parser.feed(piece) if parser is not None else [ContentDelta(piece)] if piece else []
        for event in events:
            if isinstance(event, ContentDelta):
                deltas.append((event.text, pending))
                pending = []
    for event in parser.finish() if parser is not None else []:
        if isinstance(event, ContentDelta):
            deltas.append((event.text, pending))
            pending = []
    if "".join(piece for piece, _ in deltas) != content:  # never expected: send the exact text in one piece
        logger.error("streamed content pieces do not add up to the content; sending it whole")
        return [(content, logprobs)]
    return deltas


async def _sse_events(response: ResponseObject, deltas: list[tuple[str, list[TokenLogprob]]]) -> AsyncIterator[bytes]:
    """The finished response as OpenAI's event sequence (``event:`` line, JSON with ``sequence_number``).

    The engine returns whole completions, so the events replay one (see streaming.py): created, in_progress,
    the message (item added, part added, text deltas, text done, part done, item done), each function call
    (item added, arguments delta, arguments done, item done), then ``response.completed`` or
    ``response.incomplete`` with the whole response.
    """
    sequence = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal sequence
        data = {"type": kind, "sequence_number": sequence, **fields}
        sequence += 1
        return f"event: {kind}\n".encode() + _sse(data)

    final = response.model_dump(mode="json")
    shell = {**final, "status": "in_progress", "incomplete_details": None, "output": [], "usage": None}
    yield event("response.created", response=shell)
    yield event("response.in_progress", response=shell)
    for index, item in enumerate(final["output"]):
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            part = item["content"][0]
            started = {**item, "status": "in_progress", "content": []}
            yield event("response.output_item.added", output_index=index, item=started)
            empty = {**part, "text": "", "logprobs": []}
            yield event("response.content_part.added", **where, content_index=0, part=empty)
            for piece, entries in deltas:
                yield event("response.output_text.delta", **where, content_index=0, delta=piece,
                            logprobs=[e.model_dump() for e in entries])
            yield event("response.output_text.done", **where, content_index=0, text=part["text"],
                        logprobs=part["logprobs"])
            yield event("response.content_part.done", **where, content_index=0, part=part)
        else:
            started = {**item, "status": "in_progress", "arguments": ""}
            yield event("response.output_item.added", output_index=index, item=started)
            yield event("response.function_call_arguments.delta", **where, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **where, name=item["name"],
                        arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)
