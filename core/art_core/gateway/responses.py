"""``POST /v1/responses``: OpenAI's Responses API (the OpenAI Agents SDK's default), over the completion pipeline.

A Responses request is translated into the chat completions request that means the same, and then takes
the same road as chat (``completion.Completion``): validation, sampling parameters, chat template, engine,
tool-call parsing and record. This module only translates the two ends:

    body -> stateless checks -> input items -> chat messages (+ tools, text.format, max_output_tokens)
         -> ChatCompletionRequest -> Completion (record endpoint "responses")
         -> a Response object, or its SSE events as the tokens are sampled

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
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .completion import Answer, Completion, Done, TextDelta, ToolCallDelta
from .errors import APIError
from .parsing import check_served, completion_input, json_body, new_request_id, validated
from .schemas import ChatCompletionRequest, FunctionDefinition, JsonSchemaFormat, TokenLogprob
from .state import call_headers, request_scope, request_seed
from .streaming import ClientGone, open_stream, sse, until_done

__all__ = ["ResponseObject", "ResponsesRequest", "as_chat_request", "router"]

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
    raw = await json_body(request)
    body, chat, chat_tools = as_chat_request(raw)  # from here on the pipeline does the work
    if body.model_extra:
        logger.debug("ignoring unknown or unused request fields: %s", sorted(body.model_extra))
    check_served(state, model=body.model, max_tokens=body.max_output_tokens, param="max_output_tokens")
    completion = Completion(state, completion_input(
        chat, raw, state.settings, endpoint="responses", request_id=new_request_id("resp_"), rollout_id=rollout_id,
        caller=caller, seed=request_seed(request), tools=chat_tools, max_tokens_field="max_output_tokens"))
    try:
        if body.stream:
            return await open_stream(request, completion.events(),
                                     lambda events: _sse_events(body, raw, completion, events),
                                     lambda: call_headers(completion.input.request_id, state.engine.adapter_step,
                                                          len(completion.prompt_ids), None))
        (answer,) = await until_done(request, completion.answers())
    except ClientGone:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    output: list[OutputMessage | OutputFunctionCall] = []
    if answer.content is not None:  # None only when the model called tools and wrote no text
        output.append(_message(answer, f"msg_{uuid.uuid4().hex}"))
    output += [_function_call(call) for call in answer.tool_calls]
    headers = call_headers(completion.input.request_id, answer.adapter_step, len(completion.prompt_ids),
                           answer.completion_tokens)
    return JSONResponse(_response_object(body, raw, completion, answer, output).model_dump(mode="json"),
                        headers=headers)


def as_chat_request(raw: dict[str, Any]) -> tuple[ResponsesRequest, ChatCompletionRequest, list[dict[str, Any]]]:
    """A Responses request body as the chat completions request that means the same (see the module docstring).

    Returns:
        The typed Responses request, its chat equivalent, and the chat-format tool schemas (for the record).

    Raises:
        APIError, RequestValidationError: what the gateway cannot serve, or a bad field (answered as a 400).
    """
    _refuse_unsupported(raw)
    body, items = _validate(raw)
    chat_tools = [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
                  for tool in raw.get("tools") or []]
    return body, _as_chat_request(body, _chat_messages(body.instructions, items), chat_tools), chat_tools


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
    body = validated(ResponsesRequest, raw)  # one 400 naming every bad field
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
    return validated(_ITEM_MODELS[kind], item, at=("body", "input", index))


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
    return validated(ChatCompletionRequest, {
        "model": body.model,
        "messages": messages,
        "tools": tools or None,
        "tool_choice": {"type": "function", "function": {"name": choice.name}} if isinstance(
            choice, NamedFunctionChoice) else choice,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_completion_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls,
        "logprobs": logprobs,
        "top_logprobs": body.top_logprobs if logprobs else None,
        "response_format": None if fmt is None else {"type": fmt.type, "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict} if fmt.type == "json_schema" else None},
    })


def _response_object(body: ResponsesRequest, raw: dict[str, Any], completion: Completion, answer: Answer | None,
                     output: list[OutputMessage | OutputFunctionCall]) -> ResponseObject:
    """The Response with ``output``, plus the echoes; ``answer`` None: still in progress (no usage yet)."""
    incomplete = answer is not None and answer.finish_reason == "length"
    usage = None
    if answer is not None:
        prompt_tokens = len(completion.prompt_ids)
        usage = ResponseUsage(input_tokens=prompt_tokens, output_tokens=answer.completion_tokens,
                              total_tokens=prompt_tokens + answer.completion_tokens)
    text = raw.get("text") or {}
    params = completion.input.params
    return ResponseObject(
        id=completion.input.request_id, created_at=int(completion.created),
        status="in_progress" if answer is None else "incomplete" if incomplete else "completed",
        incomplete_details={"reason": "max_output_tokens"} if incomplete else None, model=body.model, output=output,
        usage=usage, instructions=body.instructions, metadata=body.metadata or {}, tools=raw.get("tools") or [],
        tool_choice=raw.get("tool_choice") or "auto",
        parallel_tool_calls=True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        temperature=params.temperature, top_p=params.top_p, max_output_tokens=body.max_output_tokens,
        top_logprobs=body.top_logprobs or 0, text={**text, "format": text.get("format") or {"type": "text"}},
        truncation=body.truncation or "disabled",
    )


def _message(answer: Answer, item_id: str) -> OutputMessage:
    """The message item: the answer's text (with every visible token's logprobs when asked for)."""
    return OutputMessage(id=item_id, status="incomplete" if answer.finish_reason == "length" else "completed",
                         content=[OutputText(text=answer.content or "", logprobs=answer.logprobs or [])])


def _function_call(call: Any) -> OutputFunctionCall:
    return OutputFunctionCall(id=f"fc_{uuid.uuid4().hex}", call_id=call.id, name=call.function.name,
                              arguments=call.function.arguments)


# --- streaming ------------------------------------------------------------------------------------


async def _sse_events(body: ResponsesRequest, raw: dict[str, Any], completion: Completion,
                      events: AsyncIterator[TextDelta | ToolCallDelta | Done]) -> AsyncIterator[bytes]:
    """The response as OpenAI's event sequence (``event:`` line, JSON with ``sequence_number``), live.

    created, in_progress; a message item opens at the first text (item added, part added) and takes the
    text deltas as they are sampled; a function call goes out whole once its block has parsed (item added,
    arguments delta, arguments done, item done), after closing the message before it (text done, part done,
    item done; text after the call opens another message); then ``response.completed`` or
    ``response.incomplete`` with the whole response, its items in the order they were streamed.
    """
    sequence = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal sequence
        data = {"type": kind, "sequence_number": sequence, **fields}
        sequence += 1
        return sse(data, event=kind)

    shell = _response_object(body, raw, completion, None, []).model_dump(mode="json")
    yield event("response.created", response=shell)
    yield event("response.in_progress", response=shell)
    output: list[OutputMessage | OutputFunctionCall] = []
    message: _StreamedMessage | None = None

    def open_message() -> list[bytes]:
        nonlocal message
        message = _StreamedMessage(f"msg_{uuid.uuid4().hex}", len(output))
        started = OutputMessage(id=message.id, status="in_progress", content=[])
        output.append(started)
        return [event("response.output_item.added", output_index=message.index, item=started.model_dump(mode="json")),
                event("response.content_part.added", **message.where, content_index=0,
                      part=OutputText(text="").model_dump(mode="json"))]

    def close_message(status: Literal["completed", "incomplete"], tail: list[TokenLogprob]) -> list[bytes]:
        nonlocal message
        assert message is not None
        done = OutputMessage(id=message.id, status=status, content=[
            OutputText(text="".join(message.texts), logprobs=[*message.logprobs, *tail])])
        output[message.index] = done
        part = done.content[0].model_dump(mode="json")
        where, message = message.where, None
        return [event("response.output_text.done", **where, content_index=0, text=part["text"],
                      logprobs=part["logprobs"]),
                event("response.content_part.done", **where, content_index=0, part=part),
                event("response.output_item.done", output_index=where["output_index"], item=done.model_dump(mode="json"))]

    answer: Answer | None = None
    async for item in events:
        if isinstance(item, TextDelta):
            chunks = open_message() if message is None else []
            assert message is not None
            message.texts.append(item.text)
            message.logprobs += item.logprobs or []
            chunks.append(event("response.output_text.delta", **message.where, content_index=0, delta=item.text,
                                logprobs=[e.model_dump() for e in item.logprobs or []]))
        elif isinstance(item, ToolCallDelta):
            chunks = close_message("completed", item.logprobs or []) if message is not None else []
            call = _function_call(item.call)
            output.append(call)
            where = {"item_id": call.id, "output_index": len(output) - 1}
            started = {**call.model_dump(mode="json"), "status": "in_progress", "arguments": ""}
            chunks += [event("response.output_item.added", output_index=where["output_index"], item=started),
                       event("response.function_call_arguments.delta", **where, delta=call.arguments),
                       event("response.function_call_arguments.done", **where, name=call.name,
                             arguments=call.arguments),
                       event("response.output_item.done", output_index=where["output_index"],
                             item=call.model_dump(mode="json"))]
        else:
            answer = item.answer
            chunks = []
            if message is None and answer.content is not None and not any(
                    isinstance(o, OutputMessage) for o in output):  # the model wrote nothing at all: an empty message
                chunks += open_message()
            if message is not None:
                chunks += close_message("incomplete" if answer.finish_reason == "length" else "completed",
                                        item.logprobs or [])
        for chunk in chunks:
            yield chunk
    assert answer is not None  # the pipeline ends with a Done event
    final = _response_object(body, raw, completion, answer, output).model_dump(mode="json")
    yield event("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)


class _StreamedMessage:
    """The message item being streamed: its id, its place in ``output``, its text and logprobs so far."""

    def __init__(self, item_id: str, index: int) -> None:
        self.id, self.index = item_id, index
        self.texts: list[str] = []
        self.logprobs: list[TokenLogprob] = []

    @property
    def where(self) -> dict[str, Any]:
        return {"item_id": self.id, "output_index": self.index}
