"""Demonstration mode, end to end: the same unchanged agents, their trainable calls answered by a teacher.

A real LangGraph graph (``ChatOpenAI`` with a tool, through ``ToolNode``) and real Agents SDK runs (``run`` and
``run_streamed``, Responses and chat completions) call the trainable model "agent"; inside
``demonstrations(teacher)`` those calls reach ``StandInTeacher`` (a real HTTP server on loopback) through the
recording proxy, never the gateway. The tests check that the agent saw the teacher's replies, that the trajectory
holds the conversation and the tool schemas with no token ids, and that the gateway recorded nothing.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Annotated, Any, TypedDict

import openai
import pytest
from agents import Agent, ModelSettings, function_tool
from langchain_core.messages import AnyMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.prebuilt import ToolNode, tools_condition

from art_core import SFTConfig, TrainableModel
from art_core.errors import ConfigError
from art_core.sft import read_chat_file, write_chat_file
from art_plugins import Teacher, TeacherError
from art_plugins._teacher_proxy import TeacherProxy
from art_plugins.langgraph import trainable
from art_plugins.openai_agents import TrainableRunner

QUESTION = "What is 17 * 23?"
ANSWER = "17 * 23 = 391."  # the teacher's last turn: what the agent must end with
UNREACHABLE = "http://127.0.0.1:9/v1"  # the agents' own client points here: only a routed call gets an answer


class StandInTeacher:
    """Stands in for a hosted model (OpenAI's API, a vLLM server) that the tests cannot reach: a tiny real HTTP server
    on 127.0.0.1 serving ``/v1/chat/completions`` with a script. A conversation that has no tool result yet gets a
    ``multiply`` call; one that has gets ``ANSWER``. ``fail`` makes it answer every call with that status and message.
    Every request body it got is kept in ``requests``."""

    KEY = "teacher-key"

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.fail: tuple[int, str] | None = None
        self.hold: threading.Event | None = None  # set: every answer waits for it (a teacher that does not answer)
        teacher = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802  (the http.server API)
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if self.path != "/v1/chat/completions" or self.headers.get("authorization") != f"Bearer {teacher.KEY}":
                    return self._send(404 if self.path != "/v1/chat/completions" else 401,
                                      {"error": {"message": f"no {self.path} or bad key"}})
                teacher.requests.append(body)
                if teacher.hold is not None:
                    teacher.hold.wait()
                if teacher.fail is not None:
                    status, message = teacher.fail
                    return self._send(status, {"error": {"message": message, "type": "invalid_request_error"}})
                self._send(200, teacher.completion(body))

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        if any(m["role"] == "tool" for m in body["messages"]):
            message: dict[str, Any] = {"role": "assistant", "content": ANSWER}
            finish = "stop"
        else:
            message = {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{len(self.requests)}", "type": "function",
                "function": {"name": "multiply", "arguments": json.dumps({"a": 17, "b": 23})}}]}
            finish = "tool_calls"
        return {"id": "chatcmpl-teacher", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52}}

    def as_teacher(self) -> Teacher:
        return Teacher(model="big-teacher", base_url=self.base_url, api_key=self.KEY)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def teacher() -> Iterator[StandInTeacher]:
    server = StandInTeacher()
    yield server
    server.close()


def assert_demonstration(trajectory: Any, teacher: StandInTeacher) -> None:
    """The trajectory is the teacher's run: user, its tool call, the tool's result, its answer; tools; no tokens."""
    roles = [m.role for m in trajectory.messages]
    assert roles[-4:] == ["user", "assistant", "tool", "assistant"], roles
    call = trajectory.messages[-3].tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("multiply", {"a": 17, "b": 23})
    assert trajectory.messages[-2].text() == "391"
    assert trajectory.messages[-1].text() == ANSWER
    assert [t["function"]["name"] for t in trajectory.tools] == ["multiply"]
    assert trajectory.calls == [] and trajectory.additional_histories == []
    assert trajectory.metadata["demonstration"] is True
    assert trajectory.metadata["teacher"] == f"big-teacher at {teacher.base_url}"
    # The teacher was asked under its own name, with the agent's tools, and answered whole (never streamed).
    assert [r["model"] for r in teacher.requests] == ["big-teacher", "big-teacher"]
    assert all(r["tools"][0]["function"]["name"] == "multiply" and "stream" not in r for r in teacher.requests)


async def assert_gateway_untouched(model: TrainableModel, trajectory: Any) -> None:
    assert await model.fetch_rollout_records(trajectory.metadata["rollout_id"]) == []


# --- the proxy itself, with the official client ---


async def test_proxy_refuses_what_it_cannot_record(teacher: StandInTeacher):
    proxy = TeacherProxy(teacher.as_teacher())
    await proxy.start()
    try:
        url = proxy.rollout_base_url("run-1")
        async with openai.AsyncOpenAI(base_url=url, api_key=proxy.api_key, max_retries=0) as client:
            with pytest.raises(openai.BadRequestError, match="n is 2: demonstration mode records one reply"):
                await client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "hi"}],
                                                     n=2, max_tokens=8)
            reply = await client.chat.completions.create(model="agent", max_tokens=8,
                                                         messages=[{"role": "user", "content": "hi"}],
                                                         extra_headers={"X-Art-Caller": "think%20node"})
        async with openai.AsyncOpenAI(base_url=url, api_key="someone-else", max_retries=0) as stranger:
            with pytest.raises(openai.AuthenticationError, match="wrong or missing bearer token"):
                await stranger.chat.completions.create(model="agent", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.tool_calls[0].function.name == "multiply"
        (exchange,) = proxy.exchanges("run-1")
        assert exchange.caller == "think node" and exchange.messages == [{"role": "user", "content": "hi"}]
        answered = reply.choices[0].message
        assert exchange.reply == {"role": "assistant", "content": answered.content,
                                  "tool_calls": [c.model_dump() for c in answered.tool_calls or []]}
        assert proxy.exchanges("run-2") == [] and teacher.requests[0]["max_tokens"] == 8
        with pytest.raises(ConfigError, match="rollout id"):
            proxy.rollout_base_url("a/b")
    finally:
        await proxy.aclose()


# --- LangGraph ---


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def calculator_graph(few_shot: list[tuple[str, str]] | None = None, **llm_options: Any) -> Any:
    """A ReAct loop: the chat model (the trainable "agent") with ``multiply``, and a ToolNode; ``few_shot``
    messages go before the state's in every prompt."""
    # A base URL of its own: langchain_openai caches one httpx client per base URL, whose pooled connections
    # belong to the event loop of the test that opened them.
    llm = ChatOpenAI(model="agent", base_url=f"{UNREACHABLE}/{uuid.uuid4().hex[:8]}", api_key="unused",
                     max_tokens=64, max_retries=0, **llm_options).bind_tools([multiply])

    async def think(state: State) -> dict[str, Any]:
        return {"messages": [await llm.ainvoke([*(few_shot or []), *state["messages"]])]}

    builder = StateGraph(State)
    builder.add_node("think", think)
    builder.add_node("tools", ToolNode([multiply]))
    builder.add_edge(START, "think")
    builder.add_conditional_edges("think", tools_condition)
    builder.add_edge("tools", "think")
    return builder.compile()


@pytest.mark.parametrize("streaming", [False, True], ids=["invoke", "streaming"])
async def test_langgraph_demonstration(model: TrainableModel, teacher: StandInTeacher, streaming: bool):
    agent = trainable(calculator_graph(streaming=streaming), model)
    async with agent.demonstrations(teacher.as_teacher()) as demo:
        trajectory = await demo.rollout({"messages": [("user", QUESTION)]})
    assert trajectory.final_state["messages"][-1].content == ANSWER  # what the graph saw is the teacher's reply
    assert_demonstration(trajectory, teacher)
    assert trajectory.metadata["framework"] == "langgraph"
    await assert_gateway_untouched(model, trajectory)


async def test_a_few_shot_example_in_the_prompt_is_context_not_a_demonstrated_turn(model: TrainableModel,
                                                                                 teacher: StandInTeacher):
    """A node that puts a worked example (an ``AIMessage``) in its prompt: the trajectory holds it, weighted 0, so
    SFT learns only the teacher's replies (with no token ids, every other assistant message would be trained)."""
    graph = calculator_graph(few_shot=[("user", "What is 2 * 3?"), ("assistant", "2 * 3 = 6.")])
    async with trainable(graph, model).demonstrations(teacher.as_teacher()) as demo:
        trajectory = await demo.rollout({"messages": [("user", QUESTION)]})
    weights = [(m.role, m.text() or None, (m.model_extra or {}).get("weight")) for m in trajectory.messages
               if m.role == "assistant"]
    assert weights == [("assistant", "2 * 3 = 6.", 0), ("assistant", None, None), ("assistant", ANSWER, None)]


async def test_litellm_teacher(model: TrainableModel, teacher: StandInTeacher, monkeypatch: pytest.MonkeyPatch):
    """A litellm model string: litellm's OpenAI provider, pointed at the stand-in by its usual variables."""
    monkeypatch.setenv("OPENAI_API_BASE", teacher.base_url)
    monkeypatch.setenv("OPENAI_API_KEY", teacher.KEY)
    agent = trainable(calculator_graph(), model)
    async with agent.demonstrations("openai/big-teacher") as demo:
        trajectory = await demo.rollout({"messages": [("user", QUESTION)]})
    assert trajectory.final_state["messages"][-1].content == ANSWER
    assert trajectory.metadata["teacher"] == "openai/big-teacher"
    assert [r["model"] for r in teacher.requests] == ["big-teacher", "big-teacher"]
    assert trajectory.messages[-1].text() == ANSWER and trajectory.calls == []


async def test_langgraph_group_and_chat_file(model: TrainableModel, teacher: StandInTeacher, tmp_path: Path):
    """A group of demonstrations keeps its runs apart, and writes to a chat file that reads back as it was."""
    agent = trainable(calculator_graph(), model)
    async with agent.demonstrations(teacher.as_teacher()) as demo:
        group = await demo.group({"messages": [("user", QUESTION)]}, n=3)
    assert len(group) == 3 and not group.exceptions
    assert len({t.metadata["rollout_id"] for t in group}) == 3
    path = write_chat_file(tmp_path / "demos.jsonl", group.trajectories)
    read = read_chat_file(path)
    assert [[m.model_dump(exclude_none=True) for m in t.messages] for t in read] == [
        [m.model_dump(exclude_none=True) for m in t.messages] for t in group]
    assert read[0].tools == group.trajectories[0].tools


async def test_teacher_error_is_named(model: TrainableModel, teacher: StandInTeacher):
    teacher.fail = (400, "this model does not support tools today")
    agent = trainable(calculator_graph(), model)
    async with agent.demonstrations(teacher.as_teacher()) as demo:
        with pytest.raises(TeacherError, match=r"teacher big-teacher at .* answered 400: this model does not "
                                               r"support tools today"):
            await demo.rollout({"messages": [("user", QUESTION)]})


async def test_unreachable_teacher_is_named(model: TrainableModel):
    agent = trainable(calculator_graph(), model)
    async with agent.demonstrations(Teacher(model="big-teacher", base_url=UNREACHABLE)) as demo:
        with pytest.raises(TeacherError, match=r"teacher big-teacher at http://127.0.0.1:9/v1 is unreachable"):
            await demo.rollout({"messages": [("user", QUESTION)]})


async def test_a_teacher_that_does_not_answer_in_time_is_named_with_the_setting(model: TrainableModel,
                                                                                 teacher: StandInTeacher):
    teacher.hold = threading.Event()  # never set before the call gives up: the server holds every answer
    slow = Teacher(model="big-teacher", base_url=teacher.base_url, api_key=teacher.KEY, timeout=0.5)
    try:
        async with trainable(calculator_graph(), model).demonstrations(slow) as demo:
            with pytest.raises(TeacherError, match=r"did not answer within Teacher\(timeout=0.5\) seconds "
                                                   r"\(ReadTimeout\): raise timeout="):
                await demo.rollout({"messages": [("user", QUESTION)]})
    finally:
        teacher.hold.set()


async def test_teacher_params_win_over_the_agents_setting_under_either_name(model: TrainableModel,
                                                                           teacher: StandInTeacher):
    """The agent's ChatOpenAI(max_tokens=64) goes out as ``max_completion_tokens``; ``Teacher(params={"max_tokens":
    ...})`` names the same setting under the other name: the teacher gets the params' value alone."""
    capped = Teacher(model="big-teacher", base_url=teacher.base_url, api_key=teacher.KEY, params={"max_tokens": 7})
    async with trainable(calculator_graph(), model).demonstrations(capped) as demo:
        await demo.rollout({"messages": [("user", QUESTION)]})
    assert [(r.get("max_tokens"), r.get("max_completion_tokens")) for r in teacher.requests] == [(7, None)] * 2


def test_teacher_configuration_errors(model: TrainableModel):
    with pytest.raises(ConfigError, match="base_url"):
        Teacher(model="x", base_url="api.openai.com/v1")
    with pytest.raises(ConfigError, match="may not set"):
        Teacher(model="x", params={"model": "y"})
    with pytest.raises(ConfigError, match="litellm model string"):
        trainable(calculator_graph(), model).demonstrations(42)  # type: ignore[arg-type]


# --- OpenAI Agents SDK ---


@function_tool
def multiply_tool(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


multiply_tool.name = "multiply"


def calculator_agent() -> Agent[Any]:
    return Agent(name="calculator", instructions="Use the multiply tool.", model="agent", tools=[multiply_tool],
                 model_settings=ModelSettings(max_tokens=64))


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_agents_sdk_demonstration(model: TrainableModel, teacher: StandInTeacher, api: str, streamed: bool):
    runner = TrainableRunner(model, api=api)  # type: ignore[arg-type]
    async with runner.demonstrations(teacher.as_teacher()) as demo:
        if streamed:
            run = demo.run_streamed(calculator_agent(), QUESTION)
            events = [event async for event in run.stream_events()]
            result, trajectory = await run.wait()
            assert events
        else:
            result, trajectory = await demo.run(calculator_agent(), QUESTION)
    assert result is not None and result.final_output == ANSWER  # the agent ended on the teacher's text
    assert_demonstration(trajectory, teacher)
    assert trajectory.messages[0].role == "system" and trajectory.metadata["framework"] == "openai-agents"
    await assert_gateway_untouched(model, trajectory)


async def test_agents_sdk_teacher_error_is_named(model: TrainableModel, teacher: StandInTeacher):
    teacher.fail = (400, "unknown parameter: max_tokens")
    async with TrainableRunner(model).demonstrations(teacher.as_teacher()) as demo:
        with pytest.raises(TeacherError, match="answered 400: unknown parameter: max_tokens"):
            await demo.run(calculator_agent(), QUESTION)
        streamed = demo.run_streamed(calculator_agent(), QUESTION)
        with pytest.raises(TeacherError, match="answered 400: unknown parameter: max_tokens"):
            await streamed.wait()


# --- the trajectory trains ---


async def test_demonstrations_train(model: TrainableModel, teacher: StandInTeacher, tmp_path: Path):
    """Demonstrations train as they come (rendered with the student's template, counted) and from the chat file
    they were written to; each SFT step is a step, and the gateway serves the checkpoint it wrote."""
    agent = trainable(calculator_graph(), model)
    async with agent.demonstrations(teacher.as_teacher()) as demo:
        group = await demo.group({"messages": [("user", QUESTION)]}, n=2)
    assert model.step == 0 and not group.exceptions
    metrics = await model.train_sft(group.trajectories, config=SFTConfig(batch_size=2, learning_rate=1e-2))
    assert model.step == 1 and metrics["samples_rerendered"] == 2.0  # no token ids: both rendered, and counted
    assert math.isfinite(metrics["loss"]) and metrics["loss"] > 0
    metrics = await model.train_sft(write_chat_file(tmp_path / "demos.jsonl", group.trajectories),
                                    config=SFTConfig(batch_size=2, learning_rate=1e-2))
    assert model.step == 2 and metrics["samples_rerendered"] == 2.0
    # The student now answers from checkpoint 2 (a real rollout, through the gateway this time).
    trajectory = await agent.rollout({"messages": [("user", QUESTION)]})
    assert trajectory.calls and trajectory.calls[0].adapter_step == 2 and "demonstration" not in trajectory.metadata


# --- the README's example ---


def readme_example() -> str:
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Demonstrations from a stronger model"):]
    start = section.index("```python\n") + len("```python\n")
    return section[start: section.index("```\n", start)]


async def test_readme_example(teacher: StandInTeacher, tiny_model_dir: Path, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]):
    """The README's example as written, its teacher the stand-in, its student the tiny model."""
    code = readme_example()
    for placeholder, value in (
            ('project="demos")', f'project="demos", base_model={str(tiny_model_dir)!r})'),
            ('path=".art"', f"path={str(tmp_path / 'art')!r}"),
            ('base_url="https://api.openai.com/v1", api_key=os.environ["OPENAI_API_KEY"]',
             f"base_url={teacher.base_url!r}, api_key={teacher.KEY!r}"),
            ('model="gpt-4.1"', 'model="big-teacher"'),
            ('ChatOpenAI(model="calc", max_tokens=64)',  # see calculator_graph: a client of its own
             f'ChatOpenAI(model="calc", max_tokens=64, base_url="{UNREACHABLE}/{uuid.uuid4().hex[:8]}", '
             'api_key="unused")'),
            ('"demos.jsonl"', repr(str(tmp_path / "demos.jsonl")))):
        assert placeholder in code
        code = code.replace(placeholder, value)
    await asyncio.to_thread(exec, compile(code, "README.md", "exec"), {"__name__": "readme"})  # asyncio.run inside
    printed = [line for line in capsys.readouterr().out.splitlines() if line.strip()]  # the step's progress: blank
    assert printed == [f"4 {ANSWER}", "1 4.0"]
    assert len(teacher.requests) == 8  # 4 runs, each a tool call and an answer
