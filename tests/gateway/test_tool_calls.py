"""Tool-call parsing: hermes and llama3 texts, broken markup, and streaming that matches the one-shot parse."""

from __future__ import annotations

import json
import random
import re

import pytest

from art_core.errors import ConfigError, LifecycleError
from art_core.gateway.tool_calls import (
    ContentDelta,
    ParsedCompletion,
    ParsedToolCall,
    StreamEvent,
    ToolCallComplete,
    ToolCallStream,
    ToolCallStyle,
    format_tool_call_id,
    parse_tool_calls,
)

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
BROKEN = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",}}\n</tool_call>'


def call(name: str, arguments: str) -> ParsedToolCall:
    return ParsedToolCall(name=name, arguments=arguments)


# --- hermes -----------------------------------------------------------------------------------------


def test_hermes_single_call_has_no_content() -> None:
    out = parse_tool_calls(WEATHER)
    assert out == ParsedCompletion(None, [call("get_weather", '{"city": "Paris"}')], 0)


def test_hermes_as_the_embedded_template_renders_it() -> None:
    # models/templates.py renders content, then "\n" before each call, calls joined by "\n".
    text = "Let me look.\n" + WEATHER + "\n" + TIME
    out = parse_tool_calls(text, style="hermes")
    assert out.content == "Let me look."
    assert out.tool_calls == [call("get_weather", '{"city": "Paris"}'), call("get_time", '{"tz": "CET"}')]
    assert out.parse_errors == 0


def test_round_trip_through_the_embedded_chat_template() -> None:
    # Render an assistant turn with the template, parse it back, send the parsed calls back as OpenAI
    # clients do (arguments as a string): the turn must render to the same text, character for character.
    render_jinja_template = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    from art_core.models.templates import CHATML_TOOLS_TEMPLATE

    def render_turn(message: dict[str, object]) -> str:
        [text], _ = render_jinja_template([[message]], chat_template=CHATML_TOOLS_TEMPLATE)
        return text.split("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")

    arguments = {"city": "Zürich", "days": [1, 2.5], "units": None}
    sent = {
        "role": "assistant",
        "content": "Looking.",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": arguments}},
            {"type": "function", "function": {"name": "get_time", "arguments": {}}},
        ],
    }
    turn = render_turn(sent)
    out = parse_tool_calls(turn)
    assert out == ParsedCompletion(
        "Looking.", [call("get_weather", json.dumps(arguments, ensure_ascii=False)), call("get_time", "{}")], 0
    )
    echoed = {
        "role": "assistant",
        "content": out.content,
        "tool_calls": [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in out.tool_calls
        ],
    }
    assert render_turn(echoed) == turn


def test_hermes_text_between_and_after_calls_is_content() -> None:
    # pieces outside blocks: "  Checking.\n" + "\nand\n" + "\nDone.\n" -> joined, then stripped
    out = parse_tool_calls("  Checking.\n" + WEATHER + "\nand\n" + TIME + "\nDone.\n")
    assert out.content == "Checking.\n\nand\n\nDone."
    assert [c.name for c in out.tool_calls] == ["get_weather", "get_time"]


def test_hermes_tolerates_whitespace_and_compact_blocks() -> None:
    text = '<tool_call>{"name":"f","arguments":{"x":1}}</tool_call>  <tool_call>  \n\n {"name": "g"} \t\n</tool_call>'
    out = parse_tool_calls(text)
    # a call without arguments gets {} (a function with no parameters)
    assert out == ParsedCompletion(None, [call("f", '{"x": 1}'), call("g", "{}")], 0)


def test_hermes_keys_in_hermes_order() -> None:
    # Hermes' own prompt lists "arguments" before "name".
    out = parse_tool_calls('<tool_call>\n{"arguments": {"q": "x"}, "name": "search"}\n</tool_call>')
    assert out.tool_calls == [call("search", '{"q": "x"}')]


def test_arguments_as_a_json_string() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": [1, 2], \\"b\\": null}"}\n</tool_call>'
    assert parse_tool_calls(text).tool_calls == [call("f", '{"a": [1, 2], "b": null}')]


def test_parameters_is_an_alias_and_arguments_wins() -> None:
    alias = parse_tool_calls('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>')
    both = parse_tool_calls('<tool_call>{"name": "f", "parameters": {"a": 1}, "arguments": {"b": 2}}</tool_call>')
    assert alias.tool_calls == [call("f", '{"a": 1}')]
    assert both.tool_calls == [call("f", '{"b": 2}')]


def test_arguments_keep_non_ascii_text_as_the_chat_template_renders_it() -> None:
    # transformers' tojson filter uses ensure_ascii=False, so "Zürich" must not become "Z\u00fcrich".
    out = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"city": "Z\\u00fcrich"}}</tool_call>')
    assert out.tool_calls == [call("f", '{"city": "Zürich"}')]


def test_invalid_json_stays_in_content_and_is_counted() -> None:
    # trailing comma: not JSON. The valid call next to it is still returned.
    out = parse_tool_calls("Trying.\n" + BROKEN + "\n" + TIME)
    assert out.content == "Trying.\n" + BROKEN
    assert out.tool_calls == [call("get_time", '{"tz": "CET"}')]
    assert out.parse_errors == 1


@pytest.mark.parametrize(
    "block",
    [
        '{"name": "f", "arguments": [1, 2]}',  # arguments not an object
        '{"name": "f", "arguments": "[1, 2]"}',  # a string, but not holding an object
        '{"name": "f", "arguments": "not json"}',
        '{"name": "f", "arguments": {"x": NaN}}',  # json accepts NaN; JSON does not
        '{"name": "", "arguments": {}}',
        '{"arguments": {}}',
        '["f", {}]',
        '{"name": "f", "arguments": {}} {"name": "g", "arguments": {}}',  # two objects in one block
        "",
    ],
)
def test_blocks_that_are_not_one_call_are_parse_errors(block: str) -> None:
    text = f"<tool_call>\n{block}\n</tool_call>"
    assert parse_tool_calls(text) == ParsedCompletion(text, [], 1)


def test_unclosed_block_at_the_end_is_parsed() -> None:
    # The model stopped before "</tool_call>" (e.g. it was a stop string).
    out = parse_tool_calls('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n')
    assert out == ParsedCompletion("Sure.", [call("f", '{"a": 1}')], 0)


@pytest.mark.parametrize("cut", ["<", "</", "</tool_", "</tool_call"])
def test_a_block_cut_inside_its_closing_tag_is_still_a_call(cut: str) -> None:
    # The length limit fell inside "</tool_call>": a few tokens fewer gave a call, so these must too.
    out = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n' + cut)
    assert out == ParsedCompletion(None, [call("f", '{"a": 1}')], 0)


def test_unclosed_truncated_block_is_content_and_counted() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "f", "argum'
    assert parse_tool_calls(text) == ParsedCompletion(text, [], 1)


def test_no_markup_is_plain_content() -> None:
    assert parse_tool_calls("  The answer is 42.\n") == ParsedCompletion("The answer is 42.", [], 0)
    assert parse_tool_calls("") == ParsedCompletion("", [], 0)
    assert parse_tool_calls("A stray </tool_call> tag.") == ParsedCompletion("A stray </tool_call> tag.", [], 0)


def test_unknown_tool_names_are_still_returned() -> None:
    out = parse_tool_calls(WEATHER, tool_names={"get_time"})
    assert out.tool_calls == [call("get_weather", '{"city": "Paris"}')]
    assert out.parse_errors == 0


# --- llama3 -----------------------------------------------------------------------------------------


def test_llama3_single_call() -> None:
    out = parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert out == ParsedCompletion(None, [call("get_weather", '{"city": "Paris"}')], 0)


def test_llama3_python_tag_and_semicolons() -> None:
    # the ";" inside the string value must not split the call
    text = '<|python_tag|>{"name": "f", "parameters": {"s": "a; b"}}; {"name": "g", "arguments": {}}'
    out = parse_tool_calls(text, style="llama3")
    assert out == ParsedCompletion(None, [call("f", '{"s": "a; b"}'), call("g", "{}")], 0)


def test_llama3_arguments_as_a_json_string() -> None:
    out = parse_tool_calls('  {"name": "f", "parameters": "{\\"n\\": 3}"}\n')
    assert out.tool_calls == [call("f", '{"n": 3}')]


def test_llama3_json_answer_that_is_not_a_call_is_content() -> None:
    # no parameters/arguments key: a JSON answer, not a call, and not an error
    text = '{"name": "Ada Lovelace", "born": 1815}'
    assert parse_tool_calls(text) == ParsedCompletion(text, [], 0)


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "f", "parameters": {"a": 1}',  # truncated
        '{"name": "f", "parameters": {"a": 1}};',  # ";" with nothing after it
        '{"name": "f", "parameters": {}} and then some prose',
        '{"name": "f", "parameters": {}}; {"answer": 42}',  # a call, then something that is not one
        "<|python_tag|>brave_search.call(query=\"weather\")",  # Llama built-in tool: not supported
        "<|python_tag|>",
    ],
)
def test_llama3_broken_calls_are_content_and_counted(text: str) -> None:
    assert parse_tool_calls(text) == ParsedCompletion(text, [], 1)


def test_braces_mid_sentence_are_content() -> None:
    text = 'Use {"name": "f", "parameters": {}} to call f; sets look like {1, 2}.'
    assert parse_tool_calls(text) == ParsedCompletion(text, [], 0)
    assert parse_tool_calls(text, style="llama3") == ParsedCompletion(text, [], 0)


def test_prose_starting_with_a_brace_is_content_without_error() -> None:
    assert parse_tool_calls("{x} is a set.") == ParsedCompletion("{x} is a set.", [], 0)


# --- style selection --------------------------------------------------------------------------------


def test_auto_prefers_hermes_markup_even_after_a_brace() -> None:
    out = parse_tool_calls('{"note": 1}\n' + WEATHER)
    assert out == ParsedCompletion('{"note": 1}', [call("get_weather", '{"city": "Paris"}')], 0)


def test_explicit_styles_parse_only_their_own_convention() -> None:
    llama = '{"name": "f", "parameters": {}}'
    assert parse_tool_calls(llama, style="hermes") == ParsedCompletion(llama, [], 0)
    assert parse_tool_calls(WEATHER, style="llama3") == ParsedCompletion(WEATHER, [], 0)
    assert parse_tool_calls(WEATHER, style="none") == ParsedCompletion(WEATHER, [], 0)
    assert parse_tool_calls(llama, style="none") == ParsedCompletion(llama, [], 0)


def test_unknown_style_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="'qwen'.*auto, hermes, llama3, none"):
        parse_tool_calls("hi", style="qwen")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        ToolCallStream(style="qwen")  # type: ignore[arg-type]


def test_tool_call_ids_look_like_openai_ones() -> None:
    ids = {format_tool_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


# --- streaming --------------------------------------------------------------------------------------

STREAM_CASES: list[tuple[str, ToolCallStyle]] = [
    ("Hello there.\nHow are you?  ", "auto"),
    ("", "auto"),
    ("   \n ", "auto"),
    (WEATHER, "auto"),
    ("  Checking.\n" + WEATHER + "\nand\n" + TIME + "\nDone.\n", "auto"),
    ("Let me look.\n" + WEATHER + "\n" + TIME, "hermes"),
    ("Trying.\n" + BROKEN + "\n" + TIME, "auto"),
    ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', "auto"),
    ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_', "auto"),
    ('Sure.\n<tool_call>\n{"name": "f", "argum', "auto"),
    ("a <tool_cal b <tool_call c </tool_call> d <|python_tag|>", "auto"),
    ("x <tool_call> y <tool_call>" + WEATHER[len("<tool_call>") :], "auto"),
    ("<<tool_call>\n{\"name\": \"f\"}</tool_call>>", "hermes"),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "auto"),
    ('\n<|python_tag|>{"name": "f", "parameters": {"s": "a; b"}}; {"name": "g", "arguments": {}}', "auto"),
    ('{"name": "f", "parameters": {"a": 1}', "auto"),
    ('{"name": "Ada Lovelace", "born": 1815}', "llama3"),
    ('{"note": 1}\n' + WEATHER, "auto"),
    ("<|python_tag|>brave_search.call(query=\"weather\")", "auto"),
    ("<|pyth", "auto"),
    ("<|im_end|> is a token", "auto"),
    ('Use {"name": "f", "parameters": {}} mid-sentence.', "llama3"),
    ("  " + WEATHER, "none"),
    ("Plain " + WEATHER, "llama3"),
]


def stream(pieces: list[str], style: ToolCallStyle) -> tuple[list[StreamEvent], int]:
    s = ToolCallStream(style=style)
    events: list[StreamEvent] = []
    for piece in pieces:
        events += s.feed(piece)
    events += s.finish()
    return events, s.parse_errors


def reassemble(events: list[StreamEvent], parse_errors: int) -> ParsedCompletion:
    text = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = [e for e in events if isinstance(e, ToolCallComplete)]
    assert [c.index for c in calls] == list(range(len(calls)))
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)
    assert len({c.id for c in calls}) == len(calls)
    assert all(e.text for e in events if isinstance(e, ContentDelta))  # no empty deltas
    content = None if not text and calls else text
    return ParsedCompletion(content, [ParsedToolCall(c.name, c.arguments) for c in calls], parse_errors)


def splits(text: str) -> list[list[str]]:
    """Every two-piece split, one character at a time, and 20 random multi-piece splits (fixed seed)."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    out.append(list(text))
    rng = random.Random(1234)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:])])
    return out


@pytest.mark.parametrize(("text", "style"), STREAM_CASES)
def test_stream_adds_up_to_the_one_shot_parse_at_every_split(text: str, style: ToolCallStyle) -> None:
    expected = parse_tool_calls(text, style=style)
    for pieces in splits(text):
        assert reassemble(*stream(pieces, style)) == expected, pieces


def test_stream_sends_content_at_once_but_holds_trailing_space() -> None:
    s = ToolCallStream()
    # The one-shot content is stripped, so a trailing " " waits until we know more content follows.
    assert s.feed("Hello ") == [ContentDelta("Hello")]
    assert s.feed("world") == [ContentDelta(" world")]
    assert s.feed("\n") == []
    assert s.finish() == []


def test_stream_holds_only_a_possible_tag() -> None:
    s = ToolCallStream()
    assert s.feed("Hi <tool") == [ContentDelta("Hi")]
    assert s.feed("box> ok") == [ContentDelta(" <toolbox> ok")]
    assert s.feed(" <") == []
    assert s.finish() == [ContentDelta(" <")]


def test_stream_sends_each_call_when_its_block_closes() -> None:
    s = ToolCallStream()
    assert s.feed("Checking.\n<tool_call>\n") == [ContentDelta("Checking.")]
    assert s.feed('{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_') == []
    [event] = s.feed("call>\n")
    assert isinstance(event, ToolCallComplete)
    assert (event.index, event.name, event.arguments) == (0, "get_weather", '{"city": "Paris"}')
    [event] = s.feed(TIME)
    assert isinstance(event, ToolCallComplete) and event.index == 1
    assert s.finish() == []
    assert s.parse_errors == 0


def test_stream_flushes_a_dangling_block_as_content_on_finish() -> None:
    s = ToolCallStream()
    assert s.feed('<tool_call>\n{"name": "f", ') == []
    assert s.finish() == [ContentDelta('<tool_call>\n{"name": "f",')]
    assert s.parse_errors == 1


def test_stream_buffers_a_possible_llama3_call_until_finish() -> None:
    s = ToolCallStream()
    assert s.feed("  <|python") == []
    assert s.feed('_tag|>{"name": "f", ') == []
    assert s.feed('"parameters": {}}') == []
    [event] = s.finish()
    assert isinstance(event, ToolCallComplete) and (event.name, event.arguments) == ("f", "{}")


def test_stream_with_hermes_style_does_not_buffer_braces() -> None:
    s = ToolCallStream(style="hermes")
    assert s.feed("{x} is a set") == [ContentDelta("{x} is a set")]


def test_stream_cannot_be_used_after_finish() -> None:
    s = ToolCallStream()
    s.finish()
    with pytest.raises(LifecycleError, match="after finish"):
        s.feed("more")
    with pytest.raises(LifecycleError):
        s.finish()


def test_parsed_arguments_are_valid_json_objects() -> None:
    for text, style in STREAM_CASES:
        for c in parse_tool_calls(text, style=style).tool_calls:
            assert isinstance(json.loads(c.arguments), dict)
