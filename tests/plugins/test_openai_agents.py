"""The OpenAI Agents SDK adapter, end to end: real SDK runs against the real gateway through LocalBackend.

The model is a tiny Qwen2 fitted to follow the conversations of ``script()`` (``tests/scripted_model.py``):
for each prompt the SDK sends, rendered as the gateway renders it, it greedily writes the scripted turn
(a tool call or the answer). It runs on the real engine, so ids, log-probabilities, tool-call parsing and
the GRPO step are all real; only its skill is scripted. A prompt off the script gets gibberish, which
makes the tests fail loudly rather than pass by luck.

One backend serves the module (one event loop for the module): the GRPO test comes last, since it moves
the model to step 1. Agents are built fresh per test, as users build theirs.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
from agents import (
    Agent,
    GuardrailFunctionOutput,
    InputGuardrailTripwireTriggered,
    ModelSettings,
    RunConfig,
    RunContextWrapper,
    RunHooks,
    Runner,
    function_tool,
    input_guardrail,
    output_guardrail,
    set_default_openai_api,
)
from agents.handoffs import Handoff
from agents.models.openai_chatcompletions import OpenAIChatCompletionsModel
from agents.models.openai_responses import OpenAIResponsesModel
from agents.testing import ScriptedModel, assistant_message
from openai import APIConnectionError, AsyncOpenAI
from pydantic import BaseModel

from art_core import LocalBackend, TrainableModel, TrajectoryGroup
from art_core.errors import ConfigError
from art_core.training.trainer import ZeroVarianceGroupsWarning
from art_plugins import _routing
from art_plugins._agents_sdk import _builds_own_model
from art_plugins.openai_agents import NoTrainableCallsError, TrainableRunner, current_run_config

from scripted_model import Conversation, call, fit_scripted_model, say, tool_result

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "agent"  # the trainable model's name: the agents below say model="agent"
SETTINGS = ModelSettings(temperature=0, max_tokens=48)  # greedy: the scripted model answers deterministically
UNREACHABLE = "http://127.0.0.1:9/v1"  # a client pointed here only works if the call is redirected
TOOL_ERROR = "An error occurred while running the tool. Please try again."  # the SDK's default message


# --- the agents ---------------------------------------------------------------------------------------


@function_tool
def add(ctx: RunContextWrapper[Any], a: int, b: int) -> int:
    """Add two integers."""
    if isinstance(ctx.context, dict):  # tests pass a dict to see the run's settings from inside a tool
        ctx.context["tracing_disabled"] = ctx.run_config.tracing_disabled  # type: ignore[attr-defined]
    return a + b


@function_tool
def divide(a: int, b: int) -> float:
    """Divide a by b."""
    return a / b


CALCULATOR = "You are a calculator. Use the tools."


def calculator(model: Any = MODEL) -> Agent[Any]:
    return Agent(name="Calculator", instructions=CALCULATOR, tools=[add], model=model, model_settings=SETTINGS)


DIVIDER = "You divide numbers. Use the tool."


def divider() -> Agent[Any]:
    return Agent(name="Divider", instructions=DIVIDER, tools=[divide], model=MODEL, model_settings=SETTINGS)


def spanish_desk() -> Agent[Any]:
    spanish = Agent(name="Spanish", instructions="Answer in Spanish.", model=MODEL, model_settings=SETTINGS)
    return Agent(name="Triage", instructions="Hand Spanish questions to the Spanish agent.", handoffs=[spanish],
                 model=MODEL, model_settings=SETTINGS)


class Answer(BaseModel):
    answer: int


def grader() -> Agent[Any]:
    return Agent(name="Grader", instructions="Reply with the answer as JSON.", output_type=Answer, model=MODEL,
                 model_settings=SETTINGS)


# --- the script: each conversation exactly as the gateway renders the SDK's requests ---------------------


def chat_tool(name: str, description: str, parameters: dict[str, Any], *, api: str) -> dict[str, Any]:
    """A function tool as the gateway records it; the SDK orders the keys differently for each API."""
    if api == "responses":  # {"type", "name", "parameters", "strict", "description"} with "type" lifted out
        function = {"name": name, "parameters": parameters, "strict": True, "description": description}
    else:
        function = {"name": name, "description": description, "parameters": parameters, "strict": True}
    return {"type": "function", "function": function}


def tools_of(agent: Agent[Any], api: str = "responses") -> list[dict[str, Any]]:
    return [chat_tool(t.name, t.description, t.params_json_schema, api=api)  # type: ignore[union-attr]
            for t in agent.tools]


def ask(system: str, question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def handoff_script() -> list[Conversation]:
    transfer = Handoff.default_tool_name(spanish_desk().handoffs[0])  # type: ignore[arg-type]
    schema = {"additionalProperties": False, "type": "object", "properties": {}, "required": []}
    triage_tools = [chat_tool(transfer, "Handoff to the Spanish agent to handle the request. ", schema,
                              api="responses")]
    question = "¿Cuánto es 2 + 2?"
    handed_over = [call(transfer), tool_result(json.dumps({"assistant": "Spanish"}))]
    return [
        ([*ask("Hand Spanish questions to the Spanish agent.", question), *handed_over], triage_tools),
        ([*ask("Answer in Spanish.", question), *handed_over, say("Son 4.")], []),  # the Spanish agent's context
    ]


def script() -> list[Conversation]:
    conversations: list[Conversation] = []
    for api in ("responses", "chat_completions"):
        conversations.append(([*ask(CALCULATOR, "What is 3 + 4?"), call("add", a=3, b=4), tool_result("7"),
                               say("3 + 4 = 7.")], tools_of(calculator(), api)))
    tools = tools_of(calculator())
    conversations += [
        # a tool that raises: the SDK tells the model, which answers
        ([*ask(DIVIDER, "What is 1 / 0?"), call("divide", a=1, b=0), tool_result(TOOL_ERROR),
          say("I cannot divide by zero.")], tools_of(divider())),
        # a call to a tool the agent does not have (answered when the run config says to return the error)
        ([*ask(CALCULATOR, "What is 5 - 2?"), call("subtract", a=5, b=2), tool_result("Tool 'subtract' not found."),
          say("5 - 2 = 3.")], tools),
        # arguments that do not validate against the tool's schema
        ([*ask(CALCULATOR, "What is 3 + four?"), call("add", a=3, b="four"), tool_result(TOOL_ERROR),
          say("I need two numbers.")], tools),
        ([*ask("Reply with the answer as JSON.", "What is 6 * 7?"), say('{"answer": 42}')], []),
        *handoff_script(),
    ]
    return conversations


@pytest.fixture(scope="module")
def scripted_model_dir(smollm2_dir: Path) -> Path:
    return fit_scripted_model(smollm2_dir, script())


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def model(scripted_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TrainableModel]:
    model = TrainableModel(name=MODEL, project="openai-agents", base_model=scripted_model_dir)
    async with LocalBackend(path=tmp_path_factory.mktemp("art"), show_progress=False) as backend:
        await model.register(backend)
        yield model


def assert_token_exact(model: TrainableModel, trajectory: Any) -> None:
    """Every call is the gateway's record of this rollout, and each history's calls extend one another."""
    rollout_id = trajectory.metadata["rollout_id"]
    records = model.rollout_records(rollout_id)
    calls = [c for h in trajectory.histories() for c in h.calls]
    assert sorted(c.request_id for c in calls) == sorted(r.request_id for r in records)
    assert all(c.rollout_id == rollout_id for c in calls)
    for history in trajectory.histories():
        for earlier, later in itertools.pairwise(history.calls):
            exchange = earlier.prompt_token_ids + earlier.completion_token_ids
            assert later.prompt_token_ids[: len(exchange)] == exchange


def shape(trajectory: Any) -> list[tuple[str, str | None, list[str]]]:
    """(role, text, tool calls) of each message, to compare with the script at a glance."""
    return [(m.role, m.text() if m.content is not None else None,
             [f"{c.function.name}{c.function.arguments}" for c in m.tool_calls or []]) for m in trajectory.messages]


# --- runs that finish ----------------------------------------------------------------------------------


@function_tool(name_override="add", needs_approval=True)  # the script's tool, gated by a human's approval
def add_with_approval(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def test_a_run_stopped_on_output_that_does_not_parse_still_names_its_last_agent(model: TrainableModel):
    """Chat completions, an ``output_type`` and a reply cut at 3 tokens: the SDK stops the run with
    "Invalid JSON when parsing model output", an error without ``run_data``; the agent of the run's last call is
    its last agent (``metadata["last_agent"]`` was missing)."""
    agent = grader().clone(model_settings=ModelSettings(temperature=0, max_tokens=3))
    result, trajectory = await TrainableRunner(model, api="chat_completions").run(agent, "What is 6 * 7?")
    assert result is None and trajectory.metadata["stop_reason"] == "model_behavior_error"
    assert "Invalid JSON" in trajectory.metadata["error"] and trajectory.metadata["last_agent"] == "Grader"


async def test_a_run_paused_for_a_humans_approval_says_so(model: TrainableModel):
    """A tool with ``needs_approval`` pauses the run (the SDK's human-in-the-loop: ``result.interruptions``, then
    ``result.to_state()`` to resume): the trajectory is marked paused, not taken for a run that ended with no
    answer. (Resumed from ``result.to_state()``, the rest of the run is a rollout of its own.)"""
    agent = Agent(name="Calculator", instructions=CALCULATOR, tools=[add_with_approval], model=MODEL,
                  model_settings=SETTINGS)
    runner = TrainableRunner(model)
    result, trajectory = await runner.run(agent, "What is 3 + 4?")
    assert result is not None and [item.tool_name for item in result.interruptions] == ["add"]
    assert trajectory.metadata["stop_reason"] == "interrupted" and trajectory.metadata["truncated"] is True
    assert trajectory.metadata["interruptions"] == "add" and len(trajectory.calls) == 1
    assert shape(trajectory)[-1] == ("assistant", None, ['add{"a": 3, "b": 4}'])  # the call waiting for approval


async def test_function_tools(model: TrainableModel):
    runner = TrainableRunner(model)
    seen: dict[str, Any] = {}
    result, trajectory = await runner.run(calculator(), "What is 3 + 4?", context=seen,
                                          reward=lambda t, output: float(output == "3 + 4 = 7."))
    assert result is not None and result.final_output == "3 + 4 = 7."
    assert shape(trajectory) == [
        ("system", CALCULATOR, []), ("user", "What is 3 + 4?", []), ("assistant", None, ['add{"a": 3, "b": 4}']),
        ("tool", "7", []), ("assistant", "3 + 4 = 7.", [])]
    assert [t["function"]["name"] for t in trajectory.tools] == ["add"]
    assert len(trajectory.calls) == 2 and [c.caller for c in trajectory.calls] == ["Calculator", "Calculator"]
    assert trajectory.additional_histories == []
    assert_token_exact(model, trajectory)
    assert trajectory.reward == 1.0 and trajectory.final_state == "3 + 4 = 7."
    assert trajectory.metadata | {"rollout_id": None} == {
        "framework": "openai-agents", "rollout_id": None, "truncated": False, "final_output": "3 + 4 = 7.",
        "last_agent": "Calculator"}
    assert trajectory.metrics == {"tool_errors": 0} and trajectory.logs == []
    assert seen == {"tracing_disabled": True}  # nothing is exported to OpenAI
    assert not _routing.installed()  # the scope undid itself


async def test_streamed_run(model: TrainableModel):
    runner = TrainableRunner(model)
    streamed = runner.run_streamed(calculator(), "What is 3 + 4?", reward=lambda t, output: 1.0)
    text, items = "", []
    async for event in streamed.stream_events():
        if event.type == "raw_response_event" and event.data.type == "response.output_text.delta":
            text += event.data.delta
        elif event.type == "run_item_stream_event":
            items.append(event.item.type)
    assert text == "3 + 4 = 7." == streamed.result.final_output
    assert items == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    trajectory = streamed.trajectory
    assert len(trajectory.calls) == 2 and trajectory.reward == 1.0 and trajectory.final_state == "3 + 4 = 7."
    assert_token_exact(model, trajectory)
    assert await streamed.wait() == (streamed.result, trajectory)
    assert not _routing.installed()


async def test_streamed_run_without_reading_the_events(model: TrainableModel):
    result, trajectory = await TrainableRunner(model).run_streamed(calculator(), "What is 3 + 4?").wait()
    assert result.final_output == "3 + 4 = 7." and len(trajectory.calls) == 2


async def test_streamed_run_read_in_part(model: TrainableModel):
    streamed = TrainableRunner(model).run_streamed(calculator(), "What is 3 + 4?")
    async for _event in streamed.stream_events():
        break  # the reader stops at the first event; the SDK finishes the run all the same
    result, trajectory = await streamed.wait()
    assert result.final_output == "3 + 4 = 7." and len(trajectory.calls) == 2
    assert trajectory.metadata["truncated"] is False
    assert not _routing.installed()


async def test_driving_the_sdk_yourself(model: TrainableModel):
    async with TrainableRunner(model).capture() as run:
        result = await Runner.run(calculator(), "What is 3 + 4?", run_config=run.run_config())
    trajectory = run.trajectory(final_output=result.final_output, last_agent=result.last_agent)
    assert len(trajectory.calls) == 2 and trajectory.metadata["rollout_id"] == run.rollout_id
    assert [c.caller for c in trajectory.calls] == ["Calculator"] * 2


def test_an_agent_used_as_a_tool_with_a_run_config_of_its_own_is_named():
    """``agent.as_tool(..., run_config=RunConfig(...))``: the SDK runs that agent on that config, not the run's, so
    its calls escape the trainable model, and as_tool's failure handler hides a failure from the run. Said at once,
    naming the agent, the tool and the fix."""
    translator = Agent(name="French", instructions="Translate to French.", model=MODEL, model_settings=SETTINGS)
    plain = calculator().clone(tools=[add, translator.as_tool("to_french", "Translate to French.")])
    own = calculator().clone(tools=[add, translator.as_tool("to_french", "Translate to French.",
                                                               run_config=RunConfig(workflow_name="translate"))])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _builds_own_model(plain, None)
    with pytest.warns(UserWarning, match=r"'French' is used as a tool \('to_french'\) with a run_config of its own") as caught:
        _builds_own_model(own, None)
    assert "Leave run_config out of as_tool()" in str(caught[0].message) and caught[0].filename == __file__


async def test_driving_the_sdk_yourself_without_the_run_config_says_what_is_missing(
        model: TrainableModel, monkeypatch: pytest.MonkeyPatch):
    """The natural slip when wrapping existing code: ``Runner.run`` inside ``capture()`` without
    ``run_config=run.run_config()``. The SDK then calls its default client, and its OpenAI error (here a missing
    key) carries a note naming the fix."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(openai.OpenAIError) as caught:
        async with TrainableRunner(model).capture():
            await Runner.run(calculator(), "What is 3 + 4?")
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "run_config=run.run_config()" in notes, (caught.value, notes)
    assert not _routing.installed()


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "streamed"])
@pytest.mark.parametrize("way", ["api_argument", "sdk_default", "model_object"])
async def test_chat_completions(model: TrainableModel, way: str, streamed: bool):
    runner = TrainableRunner(model, api="chat_completions" if way == "api_argument" else None)
    agent = calculator(OpenAIChatCompletionsModel(model=MODEL, openai_client=AsyncOpenAI(
        base_url=UNREACHABLE, api_key="unused")) if way == "model_object" else MODEL)
    if way == "sdk_default":
        set_default_openai_api("chat_completions")
    try:
        if streamed:
            result, trajectory = await runner.run_streamed(agent, "What is 3 + 4?").wait()
        else:
            result, trajectory = await runner.run(agent, "What is 3 + 4?")
    finally:
        set_default_openai_api("responses")
    assert result is not None and result.final_output == "3 + 4 = 7."
    records = model.rollout_records(trajectory.metadata["rollout_id"])
    assert [r.endpoint for r in records] == ["chat.completions"] * 2
    assert [c.caller for c in trajectory.calls] == ["Calculator"] * 2
    assert shape(trajectory)[2:] == [("assistant", None, ['add{"a": 3, "b": 4}']), ("tool", "7", []),
                                     ("assistant", "3 + 4 = 7.", [])]
    assert_token_exact(model, trajectory)


async def test_the_http_redirect_is_installed_only_for_an_agent_with_its_own_model_object(model: TrainableModel):
    installed: list[bool] = []

    class Watch(RunHooks[Any]):
        async def on_tool_start(self, context: Any, agent: Any, tool: Any) -> None:
            installed.append(_routing.installed())  # mid-run, between the two model calls

    by_name = calculator(MODEL)  # served through the runner's model provider: no redirect needed
    by_object = calculator(OpenAIChatCompletionsModel(model=MODEL, openai_client=AsyncOpenAI(
        base_url=UNREACHABLE, api_key="unused")))  # only the redirect can reach it
    handing_off = Agent(name="Front", instructions="Hand off.", handoffs=[by_object], model=MODEL)
    for agent in (by_name, by_object):
        result, _ = await TrainableRunner(model).run(agent, "What is 3 + 4?", hooks=Watch())
        assert result is not None and result.final_output == "3 + 4 = 7."
    assert installed == [False, True] and not _routing.installed()
    async with TrainableRunner(model).capture(agent=handing_off) as run:  # a handoff's own model counts too
        assert _routing.installed() and run.scope.redirect
    async with TrainableRunner(model).capture(agent=by_name) as run:
        assert not _routing.installed() and not run.scope.redirect


async def test_the_agents_own_model_name_is_mapped(model: TrainableModel):
    runner = TrainableRunner(model, model_names=["gpt-4.1-mini"])
    by_name = calculator("gpt-4.1-mini")  # resolved by the runner's model provider
    prefixed = calculator("openai/gpt-4.1-mini")  # the SDK's provider-prefixed spelling of the same model
    by_object = calculator(OpenAIResponsesModel(model="gpt-4.1-mini", openai_client=AsyncOpenAI(
        base_url=UNREACHABLE, api_key="unused")))  # redirected at the HTTP layer
    for agent in (by_name, prefixed, by_object):
        result, trajectory = await runner.run(agent, "What is 3 + 4?")
        assert result is not None and result.final_output == "3 + 4 = 7." and len(trajectory.calls) == 2
        records = model.rollout_records(trajectory.metadata["rollout_id"])
        assert {r.model for r in records} == {MODEL}  # the gateway is asked for the model it serves


async def test_handoff_gives_a_history_per_agent(model: TrainableModel):
    result, trajectory = await TrainableRunner(model).run(spanish_desk(), "¿Cuánto es 2 + 2?")
    assert result is not None and result.final_output == "Son 4." and result.last_agent.name == "Spanish"
    assert [c.caller for c in trajectory.calls] == ["Spanish"]  # the main history: the context the run ended in
    assert trajectory.messages[0].text() == "Answer in Spanish." and trajectory.tools == []
    (triage,) = trajectory.additional_histories
    assert [c.caller for c in triage.calls] == ["Triage"]
    assert [t["function"]["name"] for t in triage.tools] == ["transfer_to_spanish"]
    assert triage.messages[-1].tool_calls[0].function.name == "transfer_to_spanish"  # type: ignore[index]
    assert trajectory.metadata["last_agent"] == "Spanish"
    assert_token_exact(model, trajectory)


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
async def test_structured_output(model: TrainableModel, api: str):
    result, trajectory = await TrainableRunner(model, api=api).run(  # type: ignore[arg-type]
        grader(), "What is 6 * 7?", reward=lambda t, output: float(output.answer == 42))
    assert result is not None and result.final_output == Answer(answer=42)
    assert trajectory.final_state == Answer(answer=42) and trajectory.reward == 1.0
    assert trajectory.metadata["final_output"] == '{"answer":42}'
    assert shape(trajectory)[-1] == ("assistant", '{"answer": 42}', [])
    (record,) = model.rollout_records(trajectory.metadata["rollout_id"])
    schema = record.request["text"]["format"] if api == "responses" else record.request["response_format"]
    assert "answer" in json.dumps(schema)  # the SDK asked for the schema; the engine decoded under it


# --- runs that stop early or go wrong ------------------------------------------------------------------


async def test_max_turns_keeps_the_trajectory(model: TrainableModel):
    finals: list[Any] = []
    result, trajectory = await TrainableRunner(model).run(
        calculator(), "What is 3 + 4?", max_turns=1, reward=lambda t, output: finals.append(output) or -1.0)
    assert result is None and finals == [None] and trajectory.reward == -1.0
    assert trajectory.metadata["truncated"] is True and trajectory.metadata["stop_reason"] == "max_turns"
    assert trajectory.metadata["error"] == "MaxTurnsExceeded: Max turns (1) exceeded"
    assert trajectory.logs == ["run stopped: MaxTurnsExceeded: Max turns (1) exceeded"]
    assert len(trajectory.calls) == 1 and shape(trajectory)[-1] == ("assistant", None, ['add{"a": 3, "b": 4}'])


async def test_max_turns_streamed_and_handled(model: TrainableModel):
    streamed = TrainableRunner(model).run_streamed(calculator(), "What is 3 + 4?", max_turns=1)
    async for _ in streamed.stream_events():  # the SDK would raise MaxTurnsExceeded here; the run is kept
        pass
    assert streamed.trajectory.metadata["stop_reason"] == "max_turns" and len(streamed.trajectory.calls) == 1
    streamed = TrainableRunner(model).run_streamed(calculator(), "What is 3 + 4?", max_turns=1)
    async for _ in streamed.stream_events():
        break  # stopped reading early: the run's end is still known
    result, trajectory = await streamed.wait()
    assert result.final_output is None and trajectory.metadata["stop_reason"] == "max_turns"
    # An error handler that gives a final output ends the run normally; the trajectory still says it was cut.
    result, trajectory = await TrainableRunner(model).run(calculator(), "What is 3 + 4?", max_turns=1,
                                                          error_handlers={"max_turns": lambda data: "gave up"})
    assert result is not None and result.final_output == "gave up" == trajectory.final_state
    assert trajectory.metadata["stop_reason"] == "max_turns" and "error" not in trajectory.metadata


async def test_tool_that_raises_is_recorded(model: TrainableModel):
    result, trajectory = await TrainableRunner(model).run(divider(), "What is 1 / 0?")
    assert result is not None and result.final_output == "I cannot divide by zero."
    assert shape(trajectory)[3] == ("tool", TOOL_ERROR, [])  # what the model was told
    (line,) = trajectory.logs  # what actually happened
    assert "'divide'" in line and "ZeroDivisionError: division by zero" in line and "'Divider'" in line
    assert trajectory.metrics["tool_errors"] == 1 and trajectory.metadata["truncated"] is False


async def test_call_to_an_unknown_tool(model: TrainableModel):
    # The SDK's default: ModelBehaviorError ends the run. The trajectory is kept, with the bad call in it.
    result, trajectory = await TrainableRunner(model).run(calculator(), "What is 5 - 2?")
    assert result is None and trajectory.metadata["stop_reason"] == "model_behavior_error"
    assert "subtract" in str(trajectory.metadata["error"])
    assert len(trajectory.calls) == 1 and shape(trajectory)[-1] == ("assistant", None, ['subtract{"a": 5, "b": 2}'])
    # Told to return the error to the model, the SDK goes on; the trajectory shows both turns.
    result, trajectory = await TrainableRunner(model).run(
        calculator(), "What is 5 - 2?", run_config=RunConfig(tool_not_found_behavior="return_error_to_model"))
    assert result is not None and result.final_output == "5 - 2 = 3."
    assert shape(trajectory)[3] == ("tool", "Tool 'subtract' not found.", [])
    (line,) = trajectory.logs
    assert "'subtract' (tool_not_found" in line and trajectory.metadata["truncated"] is False
    assert_token_exact(model, trajectory)


async def test_arguments_that_do_not_validate(model: TrainableModel):
    result, trajectory = await TrainableRunner(model).run(calculator(), "What is 3 + four?")
    assert result is not None and result.final_output == "I need two numbers."
    assert shape(trajectory)[2:4] == [("assistant", None, ['add{"a": 3, "b": "four"}']), ("tool", TOOL_ERROR, [])]
    (line,) = trajectory.logs
    assert "'add'" in line and "ModelBehaviorError: Invalid JSON input for tool add" in line


async def test_guardrails(model: TrainableModel):
    @output_guardrail
    def no_sevens(ctx: RunContextWrapper[Any], agent: Agent[Any], output: str) -> GuardrailFunctionOutput:
        return GuardrailFunctionOutput(output_info=None, tripwire_triggered="7" in output)

    @input_guardrail(run_in_parallel=False)
    def no_questions(ctx: RunContextWrapper[Any], agent: Agent[Any], text: Any) -> GuardrailFunctionOutput:
        return GuardrailFunctionOutput(output_info=None, tripwire_triggered=True)

    # The model's answer trips the output guardrail: the run is kept, marked.
    result, trajectory = await TrainableRunner(model).run(
        calculator().clone(output_guardrails=[no_sevens]), "What is 3 + 4?")
    assert result is None and trajectory.metadata["stop_reason"] == "output_guardrail"
    assert len(trajectory.calls) == 2 and shape(trajectory)[-1] == ("assistant", "3 + 4 = 7.", [])
    # The input trips a guardrail before the model is called: nothing to keep, the SDK's error is raised.
    with pytest.raises(InputGuardrailTripwireTriggered):
        await TrainableRunner(model).run(calculator().clone(input_guardrails=[no_questions]), "What is 3 + 4?")
    assert not _routing.installed()


async def test_a_guardrails_own_agent_without_the_runs_config_fails_with_a_note_naming_the_fix(
        model: TrainableModel, monkeypatch: pytest.MonkeyPatch):
    """As the SDK's guardrail docs write it, without ``current_run_config()``: the checker's call goes to the SDK's
    default client (here without a key), and its error alone never says why."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)

    @input_guardrail(run_in_parallel=False)
    async def graded(ctx: RunContextWrapper[Any], agent: Agent[Any], text: Any) -> GuardrailFunctionOutput:
        result = await Runner.run(grader(), "What is 6 * 7?")
        return GuardrailFunctionOutput(output_info=None, tripwire_triggered=result.final_output != Answer(answer=42))

    with pytest.raises(openai.OpenAIError) as raised:
        await TrainableRunner(model).run(calculator().clone(input_guardrails=[graded]), "What is 3 + 4?")
    (note,) = raised.value.__notes__
    assert "did not go to the trainable model's gateway" in note and "run_config=current_run_config()" in note


async def test_a_guardrails_own_agent_on_a_model_object_fails_with_a_note_naming_that(model: TrainableModel):
    """The checker is given ``current_run_config()`` but builds its own ``Model`` object, which no RunConfig's
    provider reaches: its call goes to that object's client (here one that cannot connect), and the note says
    so instead of suggesting the ``current_run_config()`` already passed. (Routing it is left undone.)"""
    checker = grader().clone(model=OpenAIChatCompletionsModel(model=MODEL, openai_client=AsyncOpenAI(
        base_url=UNREACHABLE, api_key="unused", max_retries=0)))

    @input_guardrail(run_in_parallel=False)
    async def graded(ctx: RunContextWrapper[Any], agent: Agent[Any], text: Any) -> GuardrailFunctionOutput:
        result = await Runner.run(checker, "What is 6 * 7?", run_config=current_run_config())
        return GuardrailFunctionOutput(output_info=None, tripwire_triggered=result.final_output != Answer(answer=42))

    with pytest.raises(APIConnectionError) as raised:
        await TrainableRunner(model).run(calculator().clone(input_guardrails=[graded]), "What is 3 + 4?")
    (note,) = raised.value.__notes__
    assert "builds its own Model object" in note and "current_run_config()" in note


async def test_an_output_guardrails_own_agent_calls_last_and_the_runs_agent_stays_the_main_history(
        model: TrainableModel):
    """An output guardrail's checker agent makes the run's last call; the main history (what a reward reads) is
    still the agent the run ended with, not the checker's (it was, before ``main_caller``)."""
    @output_guardrail
    async def graded(ctx: RunContextWrapper[Any], agent: Agent[Any], output: str) -> GuardrailFunctionOutput:
        result = await Runner.run(grader(), "What is 6 * 7?", run_config=current_run_config())
        return GuardrailFunctionOutput(output_info=None, tripwire_triggered=result.final_output != Answer(answer=42))

    result, trajectory = await TrainableRunner(model).run(calculator().clone(output_guardrails=[graded]),
                                                          "What is 3 + 4?")
    assert result is not None and result.final_output == "3 + 4 = 7."
    assert trajectory.metadata["last_agent"] == result.last_agent.name
    assert shape(trajectory)[-1] == ("assistant", "3 + 4 = 7.", [])
    assert {c.caller for c in trajectory.calls} == {result.last_agent.name} and trajectory.tools
    (checker,) = trajectory.additional_histories
    assert [c.caller for c in checker.calls] == ["Grader"] and checker.messages[-1].text() == '{"answer": 42}'
    assert_token_exact(model, trajectory)


async def test_a_guardrail_that_runs_its_own_agent_reaches_the_trainable_model(model: TrainableModel):
    """The SDK's guardrail docs run a checker agent inside the guardrail with ``Runner.run``; the SDK gives that
    run none of the outer run's configuration, so without ``current_run_config()`` it went to the SDK's default
    provider (here: "Missing credentials")."""
    checked: list[Any] = []

    @input_guardrail(run_in_parallel=False)
    async def graded(ctx: RunContextWrapper[Any], agent: Agent[Any], text: Any) -> GuardrailFunctionOutput:
        result = await Runner.run(grader(), "What is 6 * 7?", run_config=current_run_config())
        checked.append(result.final_output)
        return GuardrailFunctionOutput(output_info=None, tripwire_triggered=result.final_output != Answer(answer=42))

    result, trajectory = await TrainableRunner(model).run(calculator().clone(input_guardrails=[graded]),
                                                          "What is 3 + 4?")
    assert checked == [Answer(answer=42)] and result is not None and result.final_output == "3 + 4 = 7."
    assert shape(trajectory)[-1] == ("assistant", "3 + 4 = 7.", [])  # the outer agent's history stays main
    (nested,) = trajectory.additional_histories
    assert [c.caller for c in nested.calls] == ["Grader"] and nested.messages[-1].text() == '{"answer": 42}'
    assert_token_exact(model, trajectory)
    # Outside a captured run it hands back what it was given: the agent runs as it did before training.
    base = RunConfig(workflow_name="checks")
    assert current_run_config() is None and current_run_config(base) is base


async def test_timeout_keeps_the_trajectory(model: TrainableModel):
    class StuckTool(RunHooks[Any]):
        async def on_tool_start(self, context: Any, agent: Any, tool: Any) -> None:
            await asyncio.Event().wait()  # never set: the run hangs after its first call

    # The limit only has to outlast the tiny model's first call (a fraction of a second quiet): 10 s leaves a wide
    # margin for a loaded machine; the hook never returns, so the limit always ends the run.
    result, trajectory = await TrainableRunner(model, timeout=10).run(calculator(), "What is 3 + 4?",
                                                                      hooks=StuckTool())
    assert result is None and trajectory.metadata["stop_reason"] == "timeout" and len(trajectory.calls) == 1
    assert "timeout=10 s" in str(trajectory.metadata["error"])


async def test_concurrent_runs_stay_separate(model: TrainableModel):
    runner = TrainableRunner(model)
    runs = await asyncio.gather(*(runner.run(calculator(), "What is 3 + 4?") for _ in range(8)))
    trajectories = [trajectory for _, trajectory in runs]
    assert len({t.metadata["rollout_id"] for t in trajectories}) == 8
    for trajectory in trajectories:
        assert len(trajectory.calls) == 2 and trajectory.metadata["final_output"] == "3 + 4 = 7."
        assert_token_exact(model, trajectory)
    assert len({c.request_id for t in trajectories for c in t.calls}) == 16


async def test_a_run_that_never_calls_the_trainable_model(model: TrainableModel):
    hosted = Agent(name="Hosted", model=ScriptedModel([[assistant_message("Hi.")]]))  # any model that is not ours
    with pytest.raises(NoTrainableCallsError, match="never called the trainable model"):
        await TrainableRunner(model).run(hosted, "Hello")
    assert not _routing.installed()


async def test_a_failed_call_to_an_unrouted_model_says_it_was_not_routed(model: TrainableModel):
    # An agent with its own model object whose name the runner was not told (no model_names=["gpt-4o-mini"]):
    # the call goes to that client's endpoint, where nothing listens.
    own = OpenAIChatCompletionsModel(model="gpt-4o-mini", openai_client=AsyncOpenAI(
        base_url=UNREACHABLE, api_key="unused", max_retries=0))
    with pytest.raises(APIConnectionError) as caught:
        await TrainableRunner(model).run(calculator(own), "What is 3 + 4?")
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert f"'gpt-4o-mini' (1x); routed names: [{MODEL!r}]" in notes and "model_names=[...]" in notes
    assert not _routing.installed()


async def test_an_unknown_hosted_model_without_a_key(model: TrainableModel, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"'gpt-4o', which is not the trainable model.*model_names=\['gpt-4o'\]"):
        await TrainableRunner(model).run(calculator("gpt-4o"), "What is 3 + 4?")


async def test_configuration_errors(model: TrainableModel):
    with pytest.raises(ConfigError, match="needs a TrainableModel"):
        TrainableRunner("agent")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="api is 'grpc'"):
        TrainableRunner(model, api="grpc")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="model_names must be non-empty strings"):
        TrainableRunner(model, model_names=[""])
    with pytest.raises(ConfigError, match="timeout is 0"):
        TrainableRunner(model, timeout=0)
    runner = TrainableRunner(model)
    with pytest.raises(ConfigError, match="must be an agents.Agent"):
        await runner.run("calculator", "What is 3 + 4?")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="n is 0"):
        await runner.group(calculator(), "What is 3 + 4?", n=0)
    # Tracing stays as configured only when asked for.
    async with TrainableRunner(model, tracing=True).capture() as run:
        assert run.run_config(RunConfig()).tracing_disabled is False
    async with runner.capture() as run:
        assert run.run_config({"workflow_name": "w"}).tracing_disabled is True


def readme_example() -> str:
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## OpenAI Agents SDK"):]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```\n", start)]


async def test_readme_example(scripted_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    # The README's agent is the calculator above, so the scripted model runs it for real (greedy: it is reliable
    # only there).
    code = readme_example()
    for placeholder, value in (('base_model="smollm2-135m-instruct"', f"base_model={str(scripted_model_dir)!r}"),
                               ('path=".art"', f"path={str(tmp_path)!r}"),
                               ("ModelSettings(max_tokens=64)", "ModelSettings(max_tokens=64, temperature=0)")):
        assert placeholder in code
        code = code.replace(placeholder, value)
    with pytest.warns(ZeroVarianceGroupsWarning):  # the scripted model answers alike every time
        await asyncio.to_thread(exec, compile(code, "README.md", "exec"), {"__name__": "readme"})  # asyncio.run inside
    printed = capsys.readouterr().out.splitlines()
    # greedy runs tie: the group is dropped (the warning above), and the step line says so
    assert printed[0] == "3 + 4 = 7. 2" and printed[-1] == "step 0: mean reward 1.50, groups dropped 1", printed


# --- training (last: it moves the model to step 1) ---------------------------------------------------------


async def test_grpo_step_on_agent_runs(model: TrainableModel):
    runner = TrainableRunner(model)
    flip = itertools.cycle([1.0, 0.0])  # the runs are identical (greedy): alternate rewards to give GRPO a signal
    tools = await runner.group(calculator(), "What is 3 + 4?", n=4, reward=lambda t, output: next(flip))
    handoffs = await runner.group(spanish_desk(), "¿Cuánto es 2 + 2?", n=2, reward=lambda t, output: next(flip))
    assert isinstance(tools, TrajectoryGroup) and tools.exceptions == [] and len(tools) == 4
    assert sorted(handoffs.rewards) == [0.0, 1.0] and all(len(t.additional_histories) == 1 for t in handoffs)
    metrics = await model.train([tools, handoffs])
    assert model.step == 1
    assert metrics["samples_rerendered"] == 0  # every sample came from the gateway's token records
