"""The agent the Ray tests run on rollout workers: an unmodified LangGraph ReAct agent, imported by path.

Workers import it as ``ray_agents:solve`` (the tests put this folder on the workers' ``PYTHONPATH``). The
model is the tiny scripted Qwen2 of ``tests/scripted_model.py``, fitted to ``SCRIPT``: it calls ``add``,
then ``multiply``, then answers, greedily. The reward is random on purpose: these tests check the
machinery (routing, retries, gradients, shipping), and random rewards give every group something to train on.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from pathlib import Path
from typing import Any

from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

from art_plugins.langgraph import trainable

SYSTEM = "You are a calculator. Use the tools."
QUESTION = "What is (3 + 4) * 2?"


@tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    await asyncio.sleep(_DELAY.get("add", 0.0))
    if _GATE:
        await _wait_at_gate(Path(_GATE["folder"]))
    return a + b


async def _wait_at_gate(folder: Path) -> None:
    """Say on which node this call runs (a file named after the node), then wait until the test opens the gate.

    Lets a test hold rollouts mid-call on a node it is about to remove, whatever the machine's speed.
    """
    import ray

    node = ray.get_runtime_context().get_node_id()
    (folder / f"started-{node}-{uuid.uuid4().hex[:8]}").touch()
    while not (folder / "open").exists():
        await asyncio.sleep(0.05)


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


_DELAY: dict[str, float] = {}
_GATE: dict[str, str] = {}

TOOLS = [convert_to_openai_tool(add), convert_to_openai_tool(multiply)]


def script() -> list[Any]:
    """The conversation the scripted model is fitted to (``fit_scripted_model``)."""
    from scripted_model import call, say, tool_result

    return [([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
              call("add", a=3, b=4), tool_result("7"), call("multiply", a=7, b=2), tool_result("14"),
              say("The answer is 14.")], TOOLS)]


async def solve(model: Any, task: dict[str, Any]) -> Any:
    """One ReAct rollout of ``task``, scored at random. ``{"delay": s}``: the add tool takes ``s`` seconds;
    ``{"gate": folder}``: it waits until ``folder/open`` exists (see ``_wait_at_gate``)."""
    _DELAY["add"] = float(task.get("delay", 0.0))
    if "gate" in task:
        _GATE["folder"] = str(task["gate"])
    else:
        _GATE.clear()
    llm = ChatOpenAI(model="agent", base_url=f"http://127.0.0.1:9/{uuid.uuid4().hex[:8]}/v1", api_key="unused",
                     temperature=0.0, max_tokens=64)
    agent = trainable(create_react_agent(llm, [add, multiply], prompt=SYSTEM), model)
    return await agent.rollout({"messages": [("user", QUESTION)]}, reward=lambda t, state: random.random())
