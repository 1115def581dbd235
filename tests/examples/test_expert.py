"""The scripted experts behind ``--demos``, asked with the official openai client over loopback HTTP, as
demonstration mode asks a hosted teacher (``examples/_expert.py``, each example's ``expert.py``): the right calls
for known tasks, a 400 for a conversation an expert cannot answer, and, where cheap, the example's own graph run
against the expert (no model involved) to show its demonstrations succeed."""

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


async def test_the_tic_tac_toe_expert_wins_when_it_can_and_blocks_otherwise():
    from examples.tic_tac_toe.agent import SYSTEM as RULES
    from examples.tic_tac_toe.agent import make_move, observe
    from examples.tic_tac_toe.expert import EXPERT_NAME, best_move, tic_tac_toe_expert

    schema = [{"type": "function", "function": {"name": "make_move", "description": make_move.description,
                                                "parameters": make_move.args_schema.model_json_schema()}}]

    def position(cells: str) -> list[dict[str, str]]:  # the player node's prompt
        return [{"role": "system", "content": RULES},
                {"role": "user", "content": observe(list(cells))}]

    async with tic_tac_toe_expert() as expert:
        async with openai.AsyncOpenAI(base_url=expert.base_url, api_key="unused", max_retries=0) as client:
            moves = []
            for cells in ("XX.OO....",   # X completes the top row: cell 3
                          "X..OO..X.",   # O threatens the middle row: block at cell 6
                          "XOO.X....",   # wins now at 9, although cell 7 (a double threat) is as sure a win
                          "..X.OO...",   # blocks at 4, although cell 1 (a threat of its own) wins more often
                          "O...X...."):  # nothing urgent: the cell the expert rates best
                reply = await client.chat.completions.create(model=EXPERT_NAME, messages=position(cells),
                                                             tools=schema, tool_choice="required", max_tokens=48)
                (call,) = reply.choices[0].message.tool_calls
                assert call.function.name == "make_move"
                moves.append(json.loads(call.function.arguments))
            with pytest.raises(openai.BadRequestError, match="is over: there is no move"):
                await client.chat.completions.create(model=EXPERT_NAME, messages=position("XXXOO...."),
                                                     tools=schema, max_tokens=48)
    assert moves[:4] == [{"cell": 3}, {"cell": 6}, {"cell": 9}, {"cell": 4}]
    last = best_move(list("O...X...."))
    assert moves[4] == {"cell": last + 1} and "O...X...."[last] == "."


# --- game_2048: the expectimax player ---


async def test_the_expectimax_expert_merges_never_wastes_a_move_and_refuses_a_stuck_board():
    from examples.game_2048.agent import SYSTEM as RULES
    from examples.game_2048.agent import move, render, slide
    from examples.game_2048.expert import best_direction, expectimax_expert

    schema = [{"type": "function", "function": {"name": "move", "description": move.description,
                                                "parameters": move.args_schema.model_json_schema()}}]

    def position(board: list[list[int]]) -> list[dict[str, str]]:  # the player node's prompt
        return [{"role": "system", "content": RULES},
                {"role": "user", "content": f"Board:\n{render(board)}\nYour move?"}]

    to_win = [[8, 8, 0], [2, 0, 0], [0, 0, 0]]  # left or right merges the 8s into the target
    two_ways = [[2, 4, 8], [4, 8, 2], [8, 2, 0]]  # no merge; left and up change nothing
    async with expectimax_expert() as expert:
        async with openai.AsyncOpenAI(base_url=expert.base_url, api_key="unused", max_retries=0) as client:
            directions = []
            for board in (to_win, two_ways):
                reply = await client.chat.completions.create(model="expectimax-expert", messages=position(board),
                                                             tools=schema, tool_choice="required", max_tokens=48)
                (call,) = reply.choices[0].message.tool_calls
                assert call.function.name == "move" and reply.model == "expectimax-expert"
                directions.append(json.loads(call.function.arguments)["direction"])
            with pytest.raises(openai.BadRequestError, match="no move changes the board"):
                await client.chat.completions.create(model="expectimax-expert", tools=schema, max_tokens=48,
                                                     messages=position([[2, 4, 2], [4, 2, 4], [2, 4, 2]]))
            with pytest.raises(openai.BadRequestError, match="no 3 x 3 board"):
                await client.chat.completions.create(model="expectimax-expert", tools=schema, max_tokens=48,
                                                     messages=[{"role": "user", "content": "Your move?"}])
    assert directions == [best_direction(to_win), best_direction(two_ways)]
    assert max(map(max, slide(to_win, directions[0]))) == 16 and directions[1] in ("right", "down")


async def test_the_expectimax_expert_wins_most_seeded_games_of_the_real_graph():
    """The example's own game loop, its chat model pointed at the expert: the games the SFT step would learn from."""
    from examples.game_2048.agent import build_graph, make_tasks
    from examples.game_2048.expert import expectimax_expert

    async with expectimax_expert() as expert:
        graph = build_graph(base_url=expert.base_url)
        games = [await graph.ainvoke(dict(task)) for task in make_tasks(20, seed=20_000)]
    outcomes = [game["outcome"] for game in games]
    assert "invalid" not in outcomes and outcomes.count("won") >= 18, outcomes


# --- email_search: search, read the source, answer citing it ---


def _chat(messages) -> list[dict]:
    """LangChain messages in chat format, as ChatOpenAI sends them."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    out = []
    for m in messages:
        if isinstance(m, SystemMessage):
            out.append({"role": "system", "content": m.content})
        elif isinstance(m, HumanMessage):
            out.append({"role": "user", "content": m.content})
        elif isinstance(m, ToolMessage):
            out.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": m.content})
        elif isinstance(m, AIMessage):
            out.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["args"])}}
                for c in m.tool_calls]})
    return out


async def test_the_email_expert_searches_reads_the_source_and_answers_citing_it():
    from langchain_core.messages import SystemMessage

    from examples.email_search.agent import EXAMPLE, SYSTEM, closed_schema, make_tools
    from examples.email_search.expert import email_expert
    from examples.email_search.mailbox import Mailbox

    mailbox = Mailbox(seed=0)
    question = mailbox.questions[0]
    tools = {t.name: t for t in make_tools(mailbox)}
    schemas = [closed_schema(t) for t in tools.values()]
    conversation = [*_chat([SystemMessage(SYSTEM), *EXAMPLE]), {"role": "user", "content": question.text}]
    async with email_expert(mailbox) as expert:
        async with openai.AsyncOpenAI(base_url=expert.base_url, api_key="unused", max_retries=0) as client:
            calls = []
            for _ in range(3):  # the worked exchange's calls come before the question: context, not turns
                reply = await client.chat.completions.create(model="email-expert", messages=conversation,
                                                             tools=schemas, tool_choice="required", max_tokens=64)
                (call,) = reply.choices[0].message.tool_calls
                arguments = json.loads(call.function.arguments)
                calls.append((call.function.name, arguments))
                conversation += [reply.choices[0].message.model_dump(exclude_none=True),
                                 {"role": "tool", "tool_call_id": call.id,
                                  "content": tools[call.function.name].invoke(arguments)}]

            with pytest.raises(openai.BadRequestError, match="is not a question about this mailbox"):
                await client.chat.completions.create(model="email-expert", tools=schemas, max_tokens=64,
                                                     messages=[{"role": "user", "content": "Where is the gym?"}])
            searched_elsewhere = [{"role": "user", "content": question.text},
                                  {"role": "assistant", "content": None, "tool_calls": [{
                                      "id": "c1", "type": "function", "function": {
                                          "name": "search_inbox", "arguments": '{"keywords": "lunch"}'}}]},
                                  {"role": "tool", "tool_call_id": "c1", "content": "No emails found."}]
            with pytest.raises(openai.BadRequestError, match=f"did not list email {question.source_id}"):
                await client.chat.completions.create(model="email-expert", tools=schemas, max_tokens=64,
                                                     messages=searched_elsewhere)
    event, first = question.text.split(" the ", 1)[1].rstrip("?").split(" with ")
    assert calls == [("search_inbox", {"keywords": f"{event} {first}"}), ("read_email", {"id": question.source_id}),
                     ("return_answer", {"answer": question.answer, "source_id": question.source_id})]


async def test_the_email_expert_earns_the_full_reward_through_the_real_graph():
    """The example's graph, its chat model pointed at the expert, on the first 10 questions of two seeds."""
    from examples.email_search.agent import build_graph, grade, task_input
    from examples.email_search.expert import email_expert
    from examples.email_search.mailbox import Mailbox

    for seed in (0, 1):
        mailbox = Mailbox(seed=seed)
        async with email_expert(mailbox) as expert:
            graph = build_graph(mailbox, base_url=expert.base_url)
            for question in mailbox.questions[:10]:
                state = await graph.ainvoke(task_input(question))
                assert grade(question, state["messages"]) == {"found": 1.0, "read": 1.0, "cited": 1.0,
                                                               "answered": 1.0, "valid_tool_calls": 1.0}, question


# --- agents_sdk_support: triage, lookup, structured answer ---


async def test_the_support_expert_hands_off_looks_up_and_answers_with_the_structured_output():
    from examples.agents_sdk_support.agent import INVOICES, SERVICES, SupportAnswer, build_agent
    from examples.agents_sdk_support.expert import support_expert

    triage = build_agent()
    billing, technical = triage.handoffs
    handoffs = [{"type": "function", "function": {"name": f"transfer_to_{a.name.lower()}", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}} for a in (billing, technical)]

    def schema(agent) -> list[dict]:
        (tool,) = agent.tools
        return [{"type": "function", "function": {"name": tool.name, "parameters": tool.params_json_schema}}]

    def step(conversation: list[dict], call_id: str, name: str, arguments: dict, result: str) -> list[dict]:
        return [*conversation, {"role": "assistant", "content": None, "tool_calls": [{
            "id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]},
            {"role": "tool", "tool_call_id": call_id, "content": result}]

    async with support_expert() as expert:
        async with openai.AsyncOpenAI(base_url=expert.base_url, api_key="unused", max_retries=0) as client:
            async def turn(conversation: list[dict], tools: list[dict]):
                reply = await client.chat.completions.create(model="support-expert", messages=conversation,
                                                             tools=tools, max_tokens=64)
                message = reply.choices[0].message
                if message.tool_calls:
                    (call,) = message.tool_calls
                    return call.function.name, json.loads(call.function.arguments)
                return SupportAnswer.model_validate_json(message.content)

            for question, desk, lookup, fact in [
                    ("How much do I owe on invoice INV-1003?", billing, ("invoice_total", {"invoice_id": "INV-1003"}),
                     INVOICES["INV-1003"]),
                    ("Is login working right now?", technical, ("service_status", {"service": "login"}),
                     SERVICES["login"])]:
                asked = [{"role": "system", "content": triage.instructions}, {"role": "user", "content": question}]
                handoff = f"transfer_to_{desk.name.lower()}"
                assert await turn(asked, handoffs) == (handoff, {})
                handed = step(asked, "h1", handoff, {}, json.dumps({"assistant": desk.name}))
                assert await turn(handed, schema(desk)) == lookup
                answer = await turn(step(handed, "t1", *lookup, fact), schema(desk))
                assert answer.department == desk.name.lower() and fact in answer.reply

            with pytest.raises(openai.BadRequestError, match="neither an invoice number"):
                await client.chat.completions.create(model="support-expert", tools=handoffs, max_tokens=64,
                                                     messages=[{"role": "user", "content": "Hello there"}])
            with pytest.raises(openai.BadRequestError, match="needs the handoff 'transfer_to_billing' or the tool"):
                await client.chat.completions.create(
                    model="support-expert", tools=schema(technical), max_tokens=64,
                    messages=[{"role": "user", "content": "How much do I owe on invoice INV-1003?"}])
