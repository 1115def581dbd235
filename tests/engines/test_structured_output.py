"""Constrained decoding in the transformers engine (``SamplingParams.json_schema``, llguidance).

The tiny model has random weights, so whatever it writes unconstrained is noise: schema-valid output from
it shows the mask does the work. Schemas here bound every value (integer ranges, ``maxLength``,
``maxItems``, enums) so the noise cannot run past ``max_tokens`` before the JSON closes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai import AsyncOpenAI

from art_core.engines.base import SamplingParams
from art_core.engines.transformers import TransformersEngine
from art_core.errors import ConstraintError, EngineError
from art_core.gateway import Gateway, GatewaySettings

PROMPT = [1, 9707, 11, 1122, 359, 346, 47]

SCHEMAS = {
    "flat object": {
        "type": "object",
        "properties": {
            "answer": {"type": "integer", "minimum": 0, "maximum": 100},
            "sure": {"type": "boolean"},
            "unit": {"enum": ["cm", "m", "km"]},
        },
        "required": ["answer", "sure", "unit"],
        "additionalProperties": False,
    },
    "bounded array": {
        "type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3,
    },
    "nested, $ref and anyOf": {
        "type": "object",
        "$defs": {"score": {"type": "object", "properties": {"value": {"type": "integer", "minimum": -5,
                                                                        "maximum": 5}},
                            "required": ["value"], "additionalProperties": False}},
        "properties": {
            "scores": {"type": "array", "items": {"$ref": "#/$defs/score"}, "maxItems": 2},
            "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 8}]},
        },
        "required": ["scores", "note"],
        "additionalProperties": False,
    },
}


@pytest.fixture
async def engine(tiny_model_dir):
    engine = await TransformersEngine.from_pretrained(tiny_model_dir, device="cpu")
    yield engine
    await engine.aclose()


def decoded(engine, out) -> str:
    return engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", list(SCHEMAS))
async def test_output_follows_the_schema(engine, name):
    schema = SCHEMAS[name]
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=1, n=3, json_schema=schema)
    outputs = await engine.generate(PROMPT, params)
    for out in outputs:
        assert out.finish_reason == "stop" and out.token_ids[-1] in engine.stop_ids  # closed, then end of turn
        jsonschema.validate(json.loads(decoded(engine, out)), schema)
    greedy, = await engine.generate(PROMPT, SamplingParams(max_tokens=120, temperature=0, json_schema=schema))
    jsonschema.validate(json.loads(decoded(engine, greedy)), schema)


async def test_mixed_batch_leaves_free_rows_alone(engine):
    free = SamplingParams(max_tokens=10, temperature=0)
    constrained = SamplingParams(max_tokens=120, temperature=0, json_schema=SCHEMAS["flat object"])
    alone = engine.generate_batch([PROMPT], [free])[0][0]
    free_out, json_out = engine.generate_batch([PROMPT, PROMPT], [free, constrained])
    assert free_out[0].token_ids == alone.token_ids and free_out[0].logprobs == pytest.approx(alone.logprobs)
    jsonschema.validate(json.loads(decoded(engine, json_out[0])), SCHEMAS["flat object"])
    assert not decoded(engine, alone).lstrip().startswith("{")  # the random model writes no JSON by itself


async def test_reported_logprobs_are_the_raw_ones(engine):
    # The mask decides what may be sampled; the logprob reported is the model's own (what the trainer recomputes).
    import torch

    params = SamplingParams(max_tokens=60, temperature=0, json_schema=SCHEMAS["flat object"])
    out, = await engine.generate(PROMPT, params)
    ids = torch.tensor([PROMPT + out.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(engine.model(input_ids=ids).logits[0, :-1].float(), -1)
    rescored = logp[torch.arange(len(PROMPT) - 1, ids.shape[1] - 1), ids[0, len(PROMPT):]]
    assert (rescored - torch.tensor(out.logprobs)).abs().max().item() < 1e-4


async def test_a_schema_the_library_refuses_fails_only_its_request(engine):
    with pytest.raises(ConstraintError, match="cannot constrain output"):
        await engine.generate(PROMPT, SamplingParams(max_tokens=8, json_schema={"type": "string", "format": "nope"}))
    out, = await engine.generate(PROMPT, SamplingParams(max_tokens=4))
    assert out.token_ids


async def test_missing_llguidance_names_the_extra(engine, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # as if not installed
    with pytest.raises(EngineError, match=r"art-core\[structured\]"):
        await engine.generate(PROMPT, SamplingParams(max_tokens=8, json_schema={"type": "object"}))
    out, = await engine.generate(PROMPT, SamplingParams(max_tokens=4))  # requests without a schema still run
    assert out.token_ids


async def test_gateway_response_format_gives_schema_valid_json(engine, tmp_path):
    schema = SCHEMAS["flat object"]
    async with Gateway(engine, GatewaySettings(model_name="tiny", records_path=tmp_path / "r.jsonl")) as gateway:
        client = AsyncOpenAI(base_url=gateway.base_url, api_key="local")
        reply = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=120, seed=3,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    assert reply.choices[0].finish_reason == "stop"


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer",
                                                                                     "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping", "parameters": {}}},
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'


class Grammar:
    """Feeds text, as the tiny model's tokens, to llguidance's matcher for a request's grammar."""

    def __init__(self, tiny_model_dir: Path) -> None:
        from transformers import AutoTokenizer

        from art_core.engines._structured import JsonSchemaGuide

        self.tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        self.guide = JsonSchemaGuide(self.tokenizer, vocab_size=len(self.tokenizer),
                                     stop_ids=[self.tokenizer.eos_token_id])

    def takes(self, grammar: str, text: str) -> bool:
        """Every token of ``text`` is allowed (it may stop short of a complete reply)."""
        return self._feed(grammar, text)[0]

    def accepts(self, grammar: str, text: str) -> bool:
        """``text`` is a complete reply the grammar allows."""
        taken, matcher = self._feed(grammar, text)
        return taken and matcher.is_accepting()

    def _feed(self, grammar: str, text: str) -> tuple[bool, Any]:
        matcher = self.guide.matcher(grammar=grammar)
        return all(matcher.consume_token(t) for t in self.tokenizer.encode(text, add_special_tokens=False)), matcher


@pytest.fixture(scope="module")
def grammar(tiny_model_dir: Path) -> Grammar:
    return Grammar(tiny_model_dir)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
async def test_gateway_enforces_tool_choice(engine, tmp_path, tool_choice):
    schemas = {t["function"]["name"]: t["function"]["parameters"] or {"type": "object"} for t in TOOLS}
    async with Gateway(engine, GatewaySettings(model_name="tiny", records_path=tmp_path / "r.jsonl")) as gateway:
        client = AsyncOpenAI(base_url=gateway.base_url, api_key="local")
        reply = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice=tool_choice,
            n=3, temperature=1.0, max_tokens=200, seed=5)
    for choice in reply.choices:
        calls = choice.message.tool_calls
        assert calls, choice.message.content  # the random model never gets to answer in text
        for call in calls:
            if isinstance(tool_choice, dict):
                assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        named_one = isinstance(tool_choice, dict)
        assert not named_one or (len(calls) == 1 and choice.finish_reason == "tool_calls")


async def test_a_schema_llguidance_refuses_is_a_400_naming_it(engine, tmp_path):
    import openai

    async with Gateway(engine, GatewaySettings(model_name="tiny", records_path=tmp_path / "r.jsonl")) as gateway:
        client = AsyncOpenAI(base_url=gateway.base_url, api_key="local", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="Unknown format: nope") as caught:
            await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                response_format={"type": "json_schema", "json_schema": {
                    "name": "x", "schema": {"type": "string", "format": "nope"}}})
        assert caught.value.code == "unsupported_schema"
        ok = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=4)
        assert ok.choices[0].message.content is not None


def test_required_allows_the_reply_to_end_after_a_newline(grammar):
    """After "</tool_call>" a model most often writes a newline: "required" must let it end there, not force
    another call (half of an Agents SDK group ran into a second, cut call with the old grammar)."""
    from art_core.gateway.parsing import sampling_params
    from art_core.gateway.schemas import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                                 "tools": TOOLS, "tool_choice": "required"})
    required = sampling_params(body, GatewaySettings(model_name="tiny")).grammar
    second = CALL.replace("Oslo", "Paris")
    assert grammar.accepts(required, CALL) and grammar.accepts(required, CALL + "\n")
    assert grammar.accepts(required, CALL + "\n" + second) and grammar.accepts(required, CALL + "\n" + second + "\n")
    assert not grammar.accepts(required, CALL + "\n\n") and not grammar.accepts(required, "")


ANSWER = {"type": "object", "properties": {"department": {"enum": ["billing", "technical"]}},
          "required": ["department"], "additionalProperties": False}


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}, {"type": "json_object"}],
    ids=["json_schema", "json_object"])
def test_tools_beside_a_response_format_allow_a_call_or_the_answer(grammar, response_format):
    """``tool_choice`` "auto" with a ``response_format``, as the Agents SDK sends for an agent with tools and an
    ``output_type``: the reply may call the tools or give the structured answer. Constraining it to the schema
    alone left the tools uncallable (no lookup call in 72 runs of examples/agents_sdk_support)."""
    from art_core.gateway.parsing import sampling_params
    from art_core.gateway.schemas import ChatCompletionRequest

    request = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS,
               "response_format": response_format}
    body = ChatCompletionRequest.model_validate(request)
    params = sampling_params(body, GatewaySettings(model_name="tiny"))
    assert params.json_schema is None and params.grammar is not None

    def accepts(text: str) -> bool:
        return grammar.accepts(params.grammar, text)

    call = CALL
    assert accepts(call) and accepts(call + "\n" + call.replace("Oslo", "Paris"))
    assert accepts('{"department": "billing"}')
    assert not accepts("Hello there")  # neither a call nor the answer
    assert not accepts('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
    none = ChatCompletionRequest.model_validate({**request, "tool_choice": "none"})
    assert sampling_params(none, GatewaySettings(model_name="tiny")).grammar is None  # no tools: the schema alone


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_forced_call_beside_a_response_format_gets_calls_only(grammar, tool_choice):
    """The Agents SDK sends ``tool_choice="required"`` with the ``response_format`` of an agent's ``output_type``
    (it resets the choice after the call); OpenAI accepts the pair, and so does the gateway: this reply is a call,
    and the format shapes a later text reply. It answered 400 before."""
    from art_core.gateway.parsing import sampling_params
    from art_core.gateway.schemas import ChatCompletionRequest

    request = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS,
               "tool_choice": tool_choice, "response_format": {"type": "json_schema", "json_schema": {
                   "name": "answer", "schema": ANSWER}}}
    params = sampling_params(ChatCompletionRequest.model_validate(request), GatewaySettings(model_name="tiny"))
    assert params.json_schema is None and params.grammar is not None
    assert grammar.accepts(params.grammar, CALL)
    assert not grammar.takes(params.grammar, '{"department": "billing"}')


ORDER_TOOL = {"type": "function", "function": {"name": "order", "description": "Place an order.", "parameters": {
    # what the Agents SDK sends for def order(o: Order) with Order a Pydantic model: the model under $defs
    "$defs": {"Order": {"properties": {"item": {"type": "string"}, "qty": {"type": "integer"},
                                       "size": {"$ref": "#/$defs/Size"}},
                        "required": ["item", "qty", "size"], "type": "object", "additionalProperties": False},
              "Size": {"enum": ["small", "large"], "type": "string"}},
    "properties": {"o": {"$ref": "#/$defs/Order"}, "again": {"$ref": "#/properties/o"}},
    "required": ["o"], "type": "object", "additionalProperties": False}}}


@pytest.mark.parametrize("extra", [{"tool_choice": "required"}, {"tool_choice": "auto", "response_format": {
    "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}}], ids=["required", "beside_a_format"])
def test_a_tool_whose_arguments_use_definitions_is_constrained_by_them(grammar, extra):
    """Tool parameters with ``$defs`` and references into them (a Pydantic model, enum or dataclass as an
    argument): the grammar nests each tool's schema inside a call's, where "#/$defs/..." must still resolve.
    llguidance refused the grammar before ("Pointer '/$defs/Order' does not exist"), a 400 for every such run."""
    from art_core.gateway.parsing import sampling_params
    from art_core.gateway.schemas import ChatCompletionRequest

    request = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "tools": [ORDER_TOOL], **extra}
    params = sampling_params(ChatCompletionRequest.model_validate(request), GatewaySettings(model_name="tiny"))
    order = '{"item": "apple", "qty": 2, "size": "large"}'

    def call(arguments: str) -> str:
        return '<tool_call>\n{"name": "order", "arguments": %s}\n</tool_call>' % arguments

    assert grammar.accepts(params.grammar, call('{"o": %s}' % order))
    assert grammar.accepts(params.grammar, call('{"o": %s, "again": %s}' % (order, order)))  # "#/properties/o"
    assert not grammar.takes(params.grammar, call('{"o": {"item": "apple", "qty": 2, "size": "huge"}}'))
    assert not grammar.takes(params.grammar, call('{"o": {"item": "apple", "qty": "two", "size": "large"}}'))


@pytest.mark.parametrize("extra", [{"tool_choice": "required"},
                                   {"response_format": {"type": "json_object"}}], ids=["required", "beside_a_format"])
def test_parallel_tool_calls_false_allows_one_call(grammar, extra):
    """``parallel_tool_calls: false`` (the Agents SDK's ``ModelSettings(parallel_tool_calls=False)``): one call at
    most. A small model given "one or more" went on writing calls until its token limit (examples/agents_sdk_support's
    triage: two handoffs and a third cut at 64 tokens, which the SDK then refuses as an incomplete response)."""
    from art_core.gateway.parsing import sampling_params
    from art_core.gateway.schemas import ChatCompletionRequest

    call = CALL
    two = call + "\n" + call.replace("Oslo", "Paris")

    def accepts(parallel: bool | None, text: str) -> bool:
        request = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS, **extra,
                   **({} if parallel is None else {"parallel_tool_calls": parallel})}
        params = sampling_params(ChatCompletionRequest.model_validate(request), GatewaySettings(model_name="tiny"))
        return grammar.accepts(params.grammar, text)

    assert accepts(False, call) and not accepts(False, two)
    assert accepts(None, two) and accepts(True, two)  # unset: one or more, as before
