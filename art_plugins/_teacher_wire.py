"""The teacher's whole answer, written back in the API and mode the agent asked in.

Chat completions: a ``chat.completion`` object, or its ``chat.completion.chunk`` events (role, text, each tool
call's id and name then its arguments, the finish, usage when asked, ``[DONE]``). Responses: a ``Response``
object, or OpenAI's event sequence (created, in_progress, the message item's text, each function call item, then
completed or incomplete), built from the gateway's own response models so the two answer alike. The answer is
already whole when these run, so a stream carries it in a few events rather than token by token.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from art_core.gateway.responses import (
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from art_core.gateway.streaming import sse

from ._teacher_call import TeacherReply

if TYPE_CHECKING:
    from ._teacher_proxy import TeacherExchange

__all__ = ["chat_chunks", "chat_completion", "response_events", "response_object"]


def _usage(reply: TeacherReply) -> dict[str, int]:
    prompt, completion = reply.usage.get("prompt_tokens", 0), reply.usage.get("completion_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chat_completion(exchange: TeacherExchange, model: str, reply: TeacherReply) -> dict[str, Any]:
    """The ``chat.completion`` object (``model`` as the agent asked for it)."""
    return {"id": exchange.request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {**reply.message, "refusal": None},
                         "finish_reason": reply.finish_reason, "logprobs": None}],
            "usage": _usage(reply)}


async def chat_chunks(exchange: TeacherExchange, model: str, reply: TeacherReply, *,
                      include_usage: bool) -> AsyncIterator[bytes]:
    """The answer as ``chat.completion.chunk`` server-sent events."""
    header = {"id": exchange.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
              "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse({**header, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]})

    yield chunk({"role": "assistant", "content": ""})
    if reply.message.get("content"):
        yield chunk({"content": reply.message["content"]})
    for index, call in enumerate(reply.message.get("tool_calls") or []):
        # As OpenAI sends them: the id and name first, then the arguments.
        yield chunk({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                     "function": {"name": call["function"]["name"], "arguments": ""}}]})
        yield chunk({"tool_calls": [{"index": index, "function": {"arguments": call["function"]["arguments"]}}]})
    yield chunk({}, finish=reply.finish_reason)
    if include_usage:
        yield sse({**header, "choices": [], "usage": _usage(reply)})
    yield sse("[DONE]")


def _output(reply: TeacherReply) -> list[OutputMessage | OutputFunctionCall]:
    """The message item (when the teacher wrote text, or nothing at all), then the function calls."""
    incomplete = reply.finish_reason == "length"
    calls = reply.message.get("tool_calls") or []
    output: list[OutputMessage | OutputFunctionCall] = []
    if reply.message.get("content") is not None or not calls:
        output.append(OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="incomplete" if incomplete else "completed",
                                    content=[OutputText(text=reply.message.get("content") or "")]))
    output += [OutputFunctionCall(id=f"fc_{uuid.uuid4().hex}", call_id=call["id"], name=call["function"]["name"],
                                  arguments=call["function"]["arguments"]) for call in calls]
    return output


def _response(body: ResponsesRequest, raw: dict[str, Any], exchange: TeacherExchange, reply: TeacherReply | None,
              output: list[OutputMessage | OutputFunctionCall]) -> dict[str, Any]:
    """The ``Response`` (``reply`` None: still in progress), the request's settings echoed as the gateway does."""
    incomplete = reply is not None and reply.finish_reason == "length"
    usage = None
    if reply is not None:
        counts = _usage(reply)
        usage = ResponseUsage(input_tokens=counts["prompt_tokens"], output_tokens=counts["completion_tokens"],
                              total_tokens=counts["total_tokens"])
    text = raw.get("text") or {}
    return ResponseObject(
        id=exchange.request_id, created_at=int(time.time()),
        status="in_progress" if reply is None else "incomplete" if incomplete else "completed",
        incomplete_details={"reason": "max_output_tokens"} if incomplete else None, model=body.model, output=output,
        usage=usage, instructions=body.instructions, metadata=body.metadata or {}, tools=raw.get("tools") or [],
        tool_choice=raw.get("tool_choice") or "auto",
        parallel_tool_calls=True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, max_output_tokens=body.max_output_tokens,
        top_logprobs=body.top_logprobs or 0, text={**text, "format": text.get("format") or {"type": "text"}},
        truncation=body.truncation or "disabled",
    ).model_dump(mode="json")


def response_object(body: ResponsesRequest, raw: dict[str, Any], exchange: TeacherExchange,
                    reply: TeacherReply) -> dict[str, Any]:
    """The ``Response`` object for a Responses call that was not streamed."""
    return _response(body, raw, exchange, reply, _output(reply))


async def response_events(body: ResponsesRequest, raw: dict[str, Any], exchange: TeacherExchange,
                          reply: TeacherReply) -> AsyncIterator[bytes]:
    """The answer as the Responses API's server-sent events (``event:`` line, JSON with ``sequence_number``)."""
    sequence = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal sequence
        data = {"type": kind, "sequence_number": sequence, **fields}
        sequence += 1
        return sse(data, event=kind)

    shell = _response(body, raw, exchange, None, [])
    yield event("response.created", response=shell)
    yield event("response.in_progress", response=shell)
    output = _output(reply)
    for index, item in enumerate(output):
        done = item.model_dump(mode="json")
        if isinstance(item, OutputMessage):
            where = {"item_id": item.id, "output_index": index}
            part = done["content"][0]
            yield event("response.output_item.added", output_index=index,
                        item={**done, "status": "in_progress", "content": []})
            yield event("response.content_part.added", **where, content_index=0, part={**part, "text": ""})
            yield event("response.output_text.delta", **where, content_index=0, delta=part["text"], logprobs=[])
            yield event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **where, content_index=0, part=part)
        else:
            where = {"item_id": item.id, "output_index": index}
            yield event("response.output_item.added", output_index=index,
                        item={**done, "status": "in_progress", "arguments": ""})
            yield event("response.function_call_arguments.delta", **where, delta=item.arguments)
            yield event("response.function_call_arguments.done", **where, name=item.name, arguments=item.arguments)
        yield event("response.output_item.done", output_index=index, item=done)
    final = _response(body, raw, exchange, reply, output)
    yield event("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)
