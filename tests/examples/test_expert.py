"""The scripted expert behind ``--demos``, asked with the official openai client over loopback HTTP, as
demonstration mode asks a hosted teacher (``examples/_expert.py``, ``examples/langgraph_tools/expert.py``)."""

from __future__ import annotations

import json

import openai
import pytest

from examples._expert import ScriptedExpert, ToolCall
from examples.langgraph_tools.agent import EXAMPLE, SYSTEM, TOOLS, CalcTask
from examples.langgraph_tools.expert import calculator_expert, parse_question

# The chat-format schemas of the graph's tools, as ChatOpenAI.bind_tools sends them.
TOOL_SCHEMAS = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.args_schema.model_json_schema()}} for t in TOOLS]
# The graph's prompt before the question: the system prompt and the worked exchange (12 plus 30, with a tool result).
PROMPT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": EXAMPLE[0].content},
          {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
              "name": "add", "arguments": json.dumps({"a": 12, "b": 30})}}]},
          {"role": "tool", "tool_call_id": "call_0", "content": "42"},
          {"role": "assistant", "content": EXAMPLE[3].content}]


async def test_the_calculator_expert_calls_the_right_tool_then_answers_with_its_result():
    async with calculator_expert() as expert:
        assert expert.teacher.base_url == expert.base_url and expert.teacher.model == "calculator-expert"
        async with openai.AsyncOpenAI(base_url=expert.base_url, api_key="unused", max_retries=0) as client:
            question = [*PROMPT, {"role": "user", "content": "What is 47 times 86?"}]
            first = await client.chat.completions.create(model="calculator-expert", messages=question,
                                                         tools=TOOL_SCHEMAS, tool_choice="required", max_tokens=44)
            (call,) = first.choices[0].message.tool_calls
            assert (call.function.name, json.loads(call.function.arguments)) == ("multiply", {"a": 47, "b": 86})
            assert first.choices[0].finish_reason == "tool_calls" and first.model == "calculator-expert"

            result = [*question, first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "4042"}]
            second = await client.chat.completions.create(model="calculator-expert", messages=result,
                                                          tools=TOOL_SCHEMAS, max_tokens=20)
            assert second.choices[0].message.content == "47 times 86 is 4042."
            assert not second.choices[0].message.tool_calls and second.choices[0].finish_reason == "stop"

            # Addition asks for add; the worked example's tool result (before the question) is not this one's.
            plus = await client.chat.completions.create(
                model="calculator-expert", messages=[*PROMPT, {"role": "user", "content": "What is 15 plus 27?"}],
                tools=TOOL_SCHEMAS, max_tokens=44)
            assert json.loads(plus.choices[0].message.tool_calls[0].function.arguments) == {"a": 15, "b": 27}
            assert plus.choices[0].message.tool_calls[0].function.name == "add"

            with pytest.raises(openai.BadRequestError, match="no question of the form 'What is A plus|times B"):
                await client.chat.completions.create(model="calculator-expert", max_tokens=8,
                                                     messages=[{"role": "user", "content": "Hello!"}])
            with pytest.raises(openai.BadRequestError, match="needs the tool 'multiply'"):
                await client.chat.completions.create(model="calculator-expert", max_tokens=8, tools=TOOL_SCHEMAS[:1],
                                                     messages=[{"role": "user", "content": "What is 11 times 12?"}])
        assert len(expert.requests) == 5
    with pytest.raises(RuntimeError, match="not serving"):
        expert.base_url


async def test_a_policy_answers_in_text_or_with_a_tool_call():
    def echo(messages, tools):
        text = messages[-1]["content"]
        return ToolCall("shout", {"text": text.upper()}) if text.endswith("!") else f"you said {text}"

    async with ScriptedExpert(echo, name="echo") as expert:
        async with openai.AsyncOpenAI(base_url=expert.base_url, api_key="unused", max_retries=0) as client:
            said = await client.chat.completions.create(model="echo", max_tokens=8,
                                                        messages=[{"role": "user", "content": "hi"}])
            shouted = await client.chat.completions.create(model="echo", max_tokens=8,
                                                           messages=[{"role": "user", "content": "hi!"}])
            with pytest.raises(openai.BadRequestError, match="whole replies only"):
                await client.chat.completions.create(model="echo", max_tokens=8, stream=True,
                                                     messages=[{"role": "user", "content": "hi"}])
    assert said.choices[0].message.content == "you said hi"
    assert json.loads(shouted.choices[0].message.tool_calls[0].function.arguments) == {"text": "HI!"}


def test_parse_question_reads_the_calculator_question():
    assert parse_question("Please: What is 47 times 86? Thanks") == CalcTask(47, "times", 86)
    with pytest.raises(ValueError, match="no question"):
        parse_question("What is 47 minus 86?")


async def test_the_minimax_expert_wins_when_it_can_and_blocks_otherwise():
    from examples.tic_tac_toe.agent import SYSTEM as RULES
    from examples.tic_tac_toe.agent import make_move, render
    from examples.tic_tac_toe.expert import best_move, minimax_expert

    schema = [{"type": "function", "function": {"name": "make_move", "description": make_move.description,
                                                "parameters": make_move.args_schema.model_json_schema()}}]

    def position(cells: str) -> list[dict[str, str]]:  # the player node's prompt
        return [{"role": "system", "content": RULES},
                {"role": "user", "content": f"Board (row 1 at the top):\n{render(list(cells))}\nYour move?"}]

    async with minimax_expert() as expert:
        async with openai.AsyncOpenAI(base_url=expert.base_url, api_key="unused", max_retries=0) as client:
            moves = []
            for cells in ("XX.OO....",   # X completes the top row: (1, 3)
                          "X..OO....",   # O threatens the middle row: block at (2, 3)
                          "O...X...."):  # nothing urgent: any cell minimax rates best
                reply = await client.chat.completions.create(model="minimax-expert", messages=position(cells),
                                                             tools=schema, tool_choice="required", max_tokens=48)
                (call,) = reply.choices[0].message.tool_calls
                assert call.function.name == "make_move"
                moves.append(json.loads(call.function.arguments))
            with pytest.raises(openai.BadRequestError, match="is over: there is no move"):
                await client.chat.completions.create(model="minimax-expert", messages=position("XXXOO...."),
                                                     tools=schema, max_tokens=48)
    assert moves[:2] == [{"row": 1, "col": 3}, {"row": 2, "col": 3}]
    third = best_move(list("O...X...."))
    assert moves[2] == {"row": third // 3 + 1, "col": third % 3 + 1} and "O...X...."[third] == "."
