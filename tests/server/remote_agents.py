"""The two agents the remote test runs from a client without torch: a LangGraph ReAct graph and an Agents SDK
agent, both unmodified framework code naming the model ``"agent"``, plus the script the tiny model learns.

Imported by the test (to fit the scripted model, in the full environment) and by ``remote_client.py`` (in
the client virtualenv), so both sides build the very same agents.
"""

from __future__ import annotations

from typing import Any

from agents import Agent, ModelSettings, function_tool
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

REACT_SYSTEM = "You are a calculator. Use the tools."
REACT_QUESTION = "What is (3 + 4) * 2?"
CALCULATOR = "You add numbers. Use the tool."
SDK_QUESTION = "What is 3 + 4?"


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@function_tool
def add_numbers(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def react_graph() -> Any:
    # The base URL is never reached: the adapter routes the trainable model's calls to the server's gateway.
    llm = ChatOpenAI(model="agent", base_url="http://127.0.0.1:9/v1", api_key="unused", temperature=0.0,
                     max_tokens=64)
    return create_react_agent(llm, [add, multiply], prompt=REACT_SYSTEM)


def calculator() -> Agent[Any]:
    return Agent(name="Calculator", instructions=CALCULATOR, tools=[add_numbers], model="agent",
                 model_settings=ModelSettings(temperature=0, max_tokens=48))


def script() -> list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """Both agents' conversations, as the gateway renders them (for ``scripted_model.fit_scripted_model``)."""
    from scripted_model import call, say, tool_result

    def ask(system: str, question: str) -> list[dict[str, Any]]:
        return [{"role": "system", "content": system}, {"role": "user", "content": question}]

    react_tools = [convert_to_openai_tool(add), convert_to_openai_tool(multiply)]
    # The Agents SDK's Responses-API tool, as the gateway records it (its key order differs from Chat's).
    sdk_tools = [{"type": "function", "function": {"name": t.name, "parameters": t.params_json_schema,
                                                   "strict": True, "description": t.description}}
                 for t in calculator().tools]  # type: ignore[union-attr]
    return [
        ([*ask(REACT_SYSTEM, REACT_QUESTION), call("add", a=3, b=4), tool_result("7"), call("multiply", a=7, b=2),
          tool_result("14"), say("The answer is 14.")], react_tools),
        ([*ask(CALCULATOR, SDK_QUESTION), call("add_numbers", a=3, b=4), tool_result("7"), say("3 + 4 = 7.")],
         sdk_tools),
    ]
