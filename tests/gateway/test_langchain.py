"""LangChain's ChatOpenAI against the gateway: plain invoke, streaming, and bind_tools."""

from __future__ import annotations

from fakes import TOOL_REPLY, FakeEngine
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from art_core.gateway import Gateway


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return "18 C"


def chat(gateway: Gateway, rollout: str) -> ChatOpenAI:
    return ChatOpenAI(base_url=gateway.rollout_base_url(rollout), api_key="unused", model="agent", max_retries=0)


async def test_invoke_and_stream(gateway: Gateway, engine: FakeEngine):
    llm = chat(gateway, "lc-1")
    reply = await llm.ainvoke([HumanMessage("Hi!")])
    assert isinstance(reply, AIMessage) and reply.content == engine.reply
    assert reply.usage_metadata["output_tokens"] == len(gateway.records.for_rollout("lc-1")[0].completion_token_ids)
    pieces = [chunk.content async for chunk in llm.astream([HumanMessage("Hi!")])]
    assert "".join(pieces) == engine.reply and len(pieces) > 3
    assert len(gateway.records.for_rollout("lc-1")) == 2


async def test_bind_tools_round_trip(gateway: Gateway, engine: FakeEngine):
    engine.reply = TOOL_REPLY
    llm = chat(gateway, "lc-2").bind_tools([get_weather])
    first = await llm.ainvoke([HumanMessage("Weather in Paris?")])
    assert first.tool_calls == [{"name": "get_weather", "args": {"city": "Paris"}, "id": first.tool_calls[0]["id"],
                                 "type": "tool_call"}]
    engine.reply = "It is 18 C in Paris."
    history = [HumanMessage("Weather in Paris?"), first,
               ToolMessage(get_weather.invoke(first.tool_calls[0]["args"]), tool_call_id=first.tool_calls[0]["id"])]
    second = await llm.ainvoke(history)
    assert second.content == "It is 18 C in Paris." and not second.tool_calls
    records = gateway.records.for_rollout("lc-2")
    assert [r.finish_reason for r in records] == ["tool_calls", "stop"]
    # The second prompt starts with the first prompt and the completion the model produced, token for token,
    # except the trailing "\n" the template puts after <|im_end|>: what the trainer merges turns on.
    first_turn = records[0].prompt_token_ids + records[0].completion_token_ids
    assert records[1].prompt_token_ids[: len(first_turn)] == first_turn
