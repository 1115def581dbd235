"""Turn a model's raw completion text into OpenAI chat ``content`` and ``tool_calls``.

Two conventions are understood (``style`` picks one, or ``"auto"`` guesses from the text):

- **hermes** (Hermes 2 Pro / Hermes 3 and Qwen2.5; the embedded model's template, ``models/templates.py``,
  uses it). Zero or more blocks anywhere in the text::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  Qwen2.5 writes exactly this. Hermes' system prompt lists the keys the other way round
  (``{"arguments": <args-dict>, "name": <function-name>}``), which a JSON parser does not care about.
  Both models have ``<tool_call>`` as an added token, so the text must be decoded with that token kept.
- **llama3** (Llama 3.1 / 3.2 / 3.3 JSON tool calling). The whole completion, optionally after
  ``<|python_tag|>``, is ``{"name": ..., "parameters": {...}}``, or several such objects joined by ``;``.
  Anything else is content. Llama's built-in tools (``<|python_tag|>brave_search.call(...)``) and the
  pythonic ``[f(x=1)]`` format are not parsed; they come back as content with a parse error counted.

The rules, in both conventions:

- ``arguments`` may be an object or a JSON string holding an object; ``parameters`` is an alias (when a
  call has both, ``arguments`` wins). They come back as ``json.dumps(obj, ensure_ascii=False)``, the same
  text the chat template's ``tojson`` renders, so a call sent back by the client re-renders identically.
- A hermes block may omit ``arguments`` (a function without parameters: ``{}``); a llama3 object must
  have them, because without markup that key is what tells a call from a JSON answer like
  ``{"name": "Ada", "age": 36}``.
- Nothing here raises on model output. Markup that looks like a call but does not parse stays in
  ``content`` verbatim and adds one to ``parse_errors``: a block with invalid JSON, a llama3 text that
  starts with ``<|python_tag|>`` or holds a ``"name":`` key but is not a list of calls. A valid JSON
  answer that is not a call is just content.
- Calls to a function that is not in ``tool_names`` are returned like any other: OpenAI returns
  whatever name the model wrote, and the agent framework decides what to do about it.

``ToolCallStream`` does the same incrementally, and its events always add up to what
``parse_tool_calls`` returns for the whole text (tests check every split point).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from ..errors import ConfigError, LifecycleError

__all__ = [
    "ContentDelta",
    "ParsedCompletion",
    "ParsedToolCall",
    "StreamEvent",
    "ToolCallComplete",
    "ToolCallStream",
    "ToolCallStyle",
    "format_tool_call_id",
    "hermes_tool_call_grammar",
    "parse_tool_calls",
]

ToolCallStyle = Literal["auto", "hermes", "llama3", "none"]
"""Which convention to parse: one of the two, ``"auto"`` (guess from the text) or ``"none"`` (all content)."""

_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
# A llama3 text that failed to parse counts as a broken call only if it has a "name" key somewhere;
# otherwise it is ordinary content that happens to start with "{".
_NAME_KEY = re.compile(r'"name"\s*:')


@dataclass(frozen=True)
class ParsedToolCall:
    """One function call the model made."""

    name: str
    """The function name, as the model wrote it (not checked against the request's tools)."""
    arguments: str
    """The arguments object as JSON text: ``json.dumps(obj, ensure_ascii=False)``."""


@dataclass(frozen=True)
class ParsedCompletion:
    """A completion split into OpenAI's ``content`` and ``tool_calls``."""

    content: str | None
    """Text outside tool-call markup, stripped; ``None`` when it is empty and there are tool calls."""
    tool_calls: list[ParsedToolCall]
    """Calls in the order the model wrote them."""
    parse_errors: int
    """Markup that looked like a tool call but could not be parsed; its text stays in ``content``."""


@dataclass(frozen=True)
class ContentDelta:
    """Stream event: more content text."""

    text: str


@dataclass(frozen=True)
class ToolCallComplete:
    """Stream event: one whole tool call (name and full arguments), sent once its block has closed."""

    index: int
    """Position among this completion's calls, from 0 (OpenAI's ``tool_calls[i].index``)."""
    id: str
    """A fresh ``call_...`` id, see ``format_tool_call_id``."""
    name: str
    arguments: str


StreamEvent = ContentDelta | ToolCallComplete


def format_tool_call_id() -> str:
    """A new tool call id in OpenAI's shape: ``call_`` and 24 random hex digits (from a uuid4)."""
    return "call_" + uuid.uuid4().hex[:24]


def parse_tool_calls(
    text: str, *, tool_names: Collection[str] | None = None, style: ToolCallStyle = "auto"
) -> ParsedCompletion:
    """Split a completion into content and tool calls.

    Args:
        text: The decoded completion, without the end-of-turn token.
        tool_names: Names of the tools the request offered. Accepted so the gateway can pass them, but
            calls to other names are returned all the same (see the module docstring). Default: None.
        style: ``"hermes"``, ``"llama3"``, ``"none"`` or ``"auto"`` (default): hermes when ``<tool_call>``
            appears anywhere, else llama3 when the stripped text starts with ``{`` or
            ``<|python_tag|>``, else plain content.

    Returns:
        The content, the calls and how many call-like pieces failed to parse.

    Raises:
        ConfigError: ``style`` is not one of the four names. Model output never raises.
    """
    _check_style(style)
    if style == "auto":
        if _OPEN in text:
            style = "hermes"
        elif _looks_like_llama3(text):
            style = "llama3"
        else:
            style = "none"
    if style == "hermes":
        return _parse_hermes(text)
    if style == "llama3":
        return _parse_llama3(text)
    return _completion(text, [], 0)


class ToolCallStream:
    """Parse a completion as it streams: feed text deltas in, get content and tool-call events out.

    Content is sent as soon as it cannot be part of markup: only a possible partial ``<tool_call>`` at
    the end is held, plus trailing whitespace (which ``parse_tool_calls`` strips, and which goes out
    with the next non-blank text). A tool call is sent whole once its ``</tool_call>`` arrives. A text
    that may be llama3 (first non-blank character ``{``, or ``<|python_tag|>``) is buffered whole and
    decided by ``finish()``, because only the entire text can say whether it is a call.

    Example::

        stream = ToolCallStream()
        for delta in deltas:
            send(stream.feed(delta))
        send(stream.finish())

    Args:
        tool_names: As in ``parse_tool_calls``. Default: None.
        style: As in ``parse_tool_calls``. Default: ``"auto"``.
        call_ids: ids for the calls in order (so a stream can carry the ids a record already holds);
            new ones are made when absent or used up. Default: None.

    Raises:
        ConfigError: ``style`` is not one of the four names.
    """

    def __init__(self, *, tool_names: Collection[str] | None = None, style: ToolCallStyle = "auto",
                 call_ids: Sequence[str] | None = None) -> None:
        _check_style(style)
        self._call_ids = list(call_ids or ())
        self._tool_names = tool_names
        self._style: ToolCallStyle = style
        # "undecided" until the first non-blank text shows which path applies; then "markup" (scan for
        # <tool_call> blocks), "whole" (buffer everything for finish()) or "plain" (all content).
        self._mode: Literal["undecided", "markup", "whole", "plain"] = "undecided"
        self._buffer = ""  # text not yet sent: undecided/whole text, a partial tag, or an open block's body
        self._in_block = False
        self._pending_space = ""  # trailing whitespace held back; sent only if more content follows
        self._sent_content = False
        self._calls_sent = 0
        self._parse_errors = 0
        self._finished = False

    @property
    def parse_errors(self) -> int:
        """Call-like pieces that failed to parse so far (their text was sent as content)."""
        return self._parse_errors

    def feed(self, delta: str) -> list[StreamEvent]:
        """Take the next piece of text and return the events it completes (often none or one).

        Raises:
            LifecycleError: ``finish()`` was already called.
        """
        self._check_open("feed")
        self._buffer += delta
        if self._mode == "undecided":
            self._decide()
        if self._mode == "markup":
            return self._scan()
        if self._mode == "plain":
            text, self._buffer = self._buffer, ""
            return self._content(text)
        return []  # undecided or whole: wait

    def finish(self) -> list[StreamEvent]:
        """End of the completion: return the remaining events, including any buffered or unclosed call.

        Raises:
            LifecycleError: ``finish()`` was already called.
        """
        self._check_open("finish")
        self._finished = True
        text, self._buffer = self._buffer, ""
        if self._mode in ("undecided", "whole"):
            return self._events_from(parse_tool_calls(text, tool_names=self._tool_names, style=self._style))
        if self._in_block:
            # The model stopped inside a block (e.g. on "</tool_call>" as a stop string): parse what came.
            return self._block(text, closed=False)
        return self._content(text)  # a held partial "<tool_call" that never completed

    def _decide(self) -> None:
        head = self._buffer.lstrip()
        may_be_llama3 = self._style in ("auto", "llama3")
        if not head or (may_be_llama3 and len(head) < len(_PYTHON_TAG) and _PYTHON_TAG.startswith(head)):
            return  # nothing but whitespace yet, or the start of what may be "<|python_tag|>"
        if may_be_llama3 and _looks_like_llama3(head):
            self._mode = "whole"
        elif self._style in ("auto", "hermes"):
            self._mode = "markup"
        else:
            self._mode = "plain"

    def _scan(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while True:
            if self._in_block:
                end = self._buffer.find(_CLOSE)
                if end == -1:
                    return events
                body, self._buffer = self._buffer[:end], self._buffer[end + len(_CLOSE) :]
                self._in_block = False
                events += self._block(body, closed=True)
            else:
                start = self._buffer.find(_OPEN)
                if start == -1:
                    keep = _partial_tag_length(self._buffer, _OPEN)
                    cut = len(self._buffer) - keep
                    text, self._buffer = self._buffer[:cut], self._buffer[cut:]
                    return events + self._content(text)
                text, self._buffer = self._buffer[:start], self._buffer[start + len(_OPEN) :]
                self._in_block = True
                events += self._content(text)

    def _block(self, body: str, *, closed: bool) -> list[StreamEvent]:
        call = _call_from_json(body if closed else _unclosed(body), arguments_required=False)
        if call is None:
            self._parse_errors += 1
            return self._content(_OPEN + body + (_CLOSE if closed else ""))
        return [self._call_event(call)]

    def _call_event(self, call: ParsedToolCall) -> ToolCallComplete:
        call_id = self._call_ids[self._calls_sent] if self._calls_sent < len(self._call_ids) else format_tool_call_id()
        event = ToolCallComplete(self._calls_sent, call_id, call.name, call.arguments)
        self._calls_sent += 1
        return event

    def _content(self, text: str) -> list[StreamEvent]:
        # Send exactly what parse_tool_calls(...).content would hold: no leading whitespace before the
        # first content, and trailing whitespace only once something non-blank follows it.
        text = self._pending_space + text
        if not self._sent_content:
            text = text.lstrip()
        body = text.rstrip()
        self._pending_space = text[len(body) :]
        if not body:
            return []
        self._sent_content = True
        return [ContentDelta(body)]

    def _events_from(self, parsed: ParsedCompletion) -> list[StreamEvent]:
        self._parse_errors += parsed.parse_errors
        events: list[StreamEvent] = self._content(parsed.content or "")
        return events + [self._call_event(call) for call in parsed.tool_calls]

    def _check_open(self, method: str) -> None:
        if self._finished:
            raise LifecycleError(f"ToolCallStream.{method}() called after finish(): use one stream per completion")


# --- the two conventions -------------------------------------------------------------------------


# As engines/_structured.py writes JSON (not imported from there: it needs torch, the gateway does not).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def hermes_tool_call_grammar(tools: list[tuple[str, dict[str, Any] | None]], *, multiple: bool = True,
                             or_json: dict[str, Any] | None = None) -> str:
    """A Lark grammar (llguidance) whose every sentence is Hermes tool-call blocks, one per call::

        <tool_call>
        {"name": <one of the tools>, "arguments": <that tool's parameters schema>}
        </tool_call>

    What ``tool_choice="required"`` (``multiple=True``: one or more blocks) or a named choice (pass only
    that tool, ``multiple=False``: exactly one block) constrains a completion to. Each call is an embedded
    ``%json`` schema, written with the same fixed separators as ``json.dumps`` (``engines/_structured.py``).

    With ``or_json``, a sentence may instead be one JSON value of that schema: what ``tool_choice="auto"`` with a
    ``response_format`` means (call tools, or give the structured answer; the Agents SDK sends both for an agent
    with tools and an ``output_type``).

    Args:
        tools: ``(name, parameters schema)`` per tool; a schema of None or ``{}`` means no arguments.
        multiple: allow several blocks, separated by newlines (and a newline after the last).
        or_json: the schema of the alternative answer; None: tool calls only.
    """
    alternatives = []
    for name, parameters in tools:
        arguments, definitions = _nested_schema(parameters or {"type": "object", "properties": {},
                                                              "additionalProperties": False}, "/properties/arguments")
        schema = {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
                  "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": _JSON_OPTIONS,
                  **definitions}
        alternatives.append("%json " + json.dumps(schema))
    # A newline after a call may end the reply too: it is what the model most often writes after "</tool_call>",
    # and had it to be followed by another call, "required" would force calls the model did not choose.
    calls = 'call ("\\n" call)* "\\n"?' if multiple else "call"
    rules = [
        "%llguidance {}",
        f"start: {calls} | answer" if or_json is not None else f"start: {calls}",
        'call: "<tool_call>\\n" body "\\n</tool_call>"',
        *(f"body{i}: {alt}" for i, alt in enumerate(alternatives)),
        "body: " + " | ".join(f"body{i}" for i in range(len(alternatives))),
    ]
    if or_json is not None:
        rules.append("answer: %json " + json.dumps({**or_json, "x-guidance": _JSON_OPTIONS}))
    return "\n".join(rules) + "\n"


_DEFINITIONS = ("$defs", "definitions")


def _nested_schema(schema: dict[str, Any], at: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``schema`` made valid at JSON pointer ``at`` of an enclosing schema: its definitions (``$defs``,
    ``definitions``) are returned apart, to go to the enclosing root, where its ``"#/$defs/..."`` references point;
    its other root-relative references (``"#"``, ``"#/properties/..."``) get ``at`` in front. Pydantic models,
    dataclasses and enums as tool arguments give such schemas (the Agents SDK's, LangChain's)."""
    definitions = {key: schema[key] for key in _DEFINITIONS if key in schema}

    def moved(node: Any) -> Any:
        if isinstance(node, list):
            return [moved(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {key: moved(value) for key, value in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) and not any(
                ref.startswith(f"#/{key}/") for key in _DEFINITIONS):
            out["$ref"] = "#" + at + ref[1:]
        return out

    body = moved({key: value for key, value in schema.items() if key not in _DEFINITIONS})
    return body, {key: moved(value) for key, value in definitions.items()}


def _unclosed(body: str) -> str:
    """An unclosed block's body without the start of ``</tool_call>`` it may end with (the length limit cut the
    closing tag: ``...}\n</``), so that the call still parses."""
    return body[:len(body) - _partial_tag_length(body, _CLOSE)]


def _parse_hermes(text: str) -> ParsedCompletion:
    pieces: list[str] = []  # content: text between blocks, and blocks that failed to parse
    calls: list[ParsedToolCall] = []
    errors = 0
    pos = 0
    while (start := text.find(_OPEN, pos)) != -1:
        pieces.append(text[pos:start])
        body_start = start + len(_OPEN)
        end = text.find(_CLOSE, body_start)
        # No closing tag: the model stopped inside the block, which runs to the end of the text.
        pos = len(text) if end == -1 else end + len(_CLOSE)
        body = _unclosed(text[body_start:]) if end == -1 else text[body_start:end]
        call = _call_from_json(body, arguments_required=False)
        if call is None:
            errors += 1
            pieces.append(text[start:pos])
        else:
            calls.append(call)
    pieces.append(text[pos:])
    return _completion("".join(pieces), calls, errors)


def _parse_llama3(text: str) -> ParsedCompletion:
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    if tagged:
        body = body[len(_PYTHON_TAG) :].lstrip()
    elif not body.startswith("{"):
        return _completion(text, [], 0)  # prose: a llama3 call is the whole text, from its first "{"
    objects = _json_objects_separated_by_semicolons(body)
    if objects is not None:
        calls = [_call_from_object(obj, arguments_required=True) for obj in objects]
        if all(call is not None for call in calls):
            return _completion("", [call for call in calls if call is not None], 0)
        broken = tagged or any(call is not None for call in calls)  # some calls, some not: a broken list
    else:
        broken = tagged or _NAME_KEY.search(body) is not None
    return _completion(text, [], 1 if broken else 0)


# --- helpers --------------------------------------------------------------------------------------


def _completion(content: str, calls: list[ParsedToolCall], errors: int) -> ParsedCompletion:
    stripped = content.strip()
    return ParsedCompletion(content=None if not stripped and calls else stripped, tool_calls=calls, parse_errors=errors)


def _looks_like_llama3(text: str) -> bool:
    head = text.lstrip()
    return head.startswith("{") or head.startswith(_PYTHON_TAG)


def _json_objects_separated_by_semicolons(text: str) -> list[Any] | None:
    """The JSON values in ``a; b; c`` (whitespace allowed around each), or None if it is not that."""
    decoder = json.JSONDecoder(parse_constant=_reject_constant)
    values: list[Any] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        try:
            # raw_decode, not split(";"): a ";" inside a string value must not split a call.
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return values
        if text[pos] != ";":
            return None
        pos += 1


def _call_from_json(text: str, *, arguments_required: bool) -> ParsedToolCall | None:
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except ValueError:  # json.JSONDecodeError is a ValueError, and so is _reject_constant's
        return None
    return _call_from_object(obj, arguments_required=arguments_required)


def _call_from_object(obj: Any, *, arguments_required: bool) -> ParsedToolCall | None:
    """A call from ``{"name": str, "arguments" | "parameters": object or JSON text}``, or None."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    key = "arguments" if "arguments" in obj else "parameters" if "parameters" in obj else None
    if key is None:
        if arguments_required:
            return None
        arguments: Any = {}
    else:
        arguments = obj[key]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments, parse_constant=_reject_constant)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    # ensure_ascii=False and default separators: the same text as the chat template's tojson filter.
    return ParsedToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def _reject_constant(constant: str) -> Any:
    # json accepts NaN and Infinity, but they are not JSON and OpenAI clients could not read them back.
    raise ValueError(f"{constant} is not valid JSON")


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag`` (0 if none)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def _check_style(style: str) -> None:
    if style not in get_args(ToolCallStyle):
        raise ConfigError(f"tool call style {style!r} is not known: use one of {', '.join(get_args(ToolCallStyle))}")
