"""Server-sent events for ``stream=true``: a finished completion sent as OpenAI chunks.

The engine returns whole completions, so the stream starts only once generation is over; it then sends
the completion token by token (tool calls as tool-call deltas), exactly as a live stream would look.
Streaming while generating is future work: it needs a streaming ``Engine.generate``.

The records are written before the first chunk, so a client that drops the stream loses nothing the
trainer needs.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from .tokens import Detokenizer
from .tool_calls import ContentDelta, StreamEvent, ToolCallStream

__all__ = ["StreamedChoice", "sse_chunks"]


@dataclass(frozen=True)
class StreamedChoice:
    """What one choice's chunks are made of."""

    index: int
    token_ids: list[int]
    """Completion ids as the engine returned them (special tokens are dropped when decoding)."""
    text: str
    """The decoded completion the chunks must add up to (before tool-call parsing)."""
    finish_reason: str
    logprobs: list[dict[str, Any]] | None
    """OpenAI token entries, one per visible token, or None when the client did not ask."""
    tool_names: list[str] | None
    """Tools offered (tool calls are parsed); None: the text is all content."""
    tool_call_ids: list[str] = field(default_factory=list)
    """Ids of the parsed tool calls, in order (the ones the record holds)."""


def _sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


async def sse_chunks(
    choices: list[StreamedChoice],
    *,
    detokenizer: Detokenizer,
    header: dict[str, Any],
    usage: dict[str, int] | None,
) -> AsyncIterator[bytes]:
    """The SSE body: each choice's chunks in turn, the usage chunk (when asked for), then ``[DONE]``.

    Args:
        choices: the choices to send.
        detokenizer: splits each completion into per-token text pieces.
        header: fields every chunk repeats (id, object, created, model, system_fingerprint).
        usage: token counts for the last chunk; None when ``stream_options.include_usage`` was not set.
    """

    def chunk(
        index: int, delta: dict[str, Any], *, finish: str | None = None, logprobs: list[Any] | None = None
    ) -> bytes:
        choice = {"index": index, "delta": delta, "finish_reason": finish,
                  "logprobs": {"content": logprobs, "refusal": None} if logprobs is not None else None}
        return _sse({**header, "choices": [choice]})

    for choice in choices:
        yield chunk(choice.index, {"role": "assistant", "content": ""})
        parser = ToolCallStream(tool_names=choice.tool_names, call_ids=choice.tool_call_ids) if choice.tool_names is not None else None
        entries = choice.logprobs or []
        pending: list[dict[str, Any]] = []  # logprob entries of tokens whose text has not gone out yet
        used = 0

        def deltas(events: list[StreamEvent]) -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = []
            for event in events:
                if isinstance(event, ContentDelta):
                    out.append({"content": event.text})
                else:  # a whole tool call: OpenAI sends its id and name first, then the arguments
                    out.append({"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                                "function": {"name": event.name, "arguments": ""}}]})
                    out.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]})
            return out

        for piece, count in detokenizer.text_pieces(choice.token_ids, choice.text):
            pending += entries[used : used + count]
            used += count
            events = parser.feed(piece) if parser is not None else ([ContentDelta(piece)] if piece else [])
            for delta in deltas(events):
                lp = pending if choice.logprobs is not None else None
                yield chunk(choice.index, delta, logprobs=lp)
                pending = []
        for delta in deltas(parser.finish() if parser is not None else []):
            yield chunk(choice.index, delta, logprobs=pending if choice.logprobs is not None else None)
            pending = []
        pending += entries[used:]
        yield chunk(choice.index, {}, finish=choice.finish_reason,
                    logprobs=pending if choice.logprobs is not None and pending else None)
    if usage is not None:
        yield _sse({**header, "choices": [], "usage": usage})
    yield _sse("[DONE]")
