"""Langfuse's LangChain ``CallbackHandler`` made lighter for LangGraph rollouts (used by ``art_plugins.langfuse``).

Langfuse's handler runs inline on the agent's own task, and each observation costs the SDK a fixed amount of
work there: an OpenTelemetry span, its attributes (one JSON text per metadata key), a media scan and a JSON
encoding of its input and output; then its export. This subclass does that work less often:

- **Graph states as text.** A LangGraph node's input is the whole graph state and its output a state update.
  Their LangChain messages are shown as Langfuse shows a generation's (role, content, tool calls, tool call id,
  name), not as each message's full ``model_dump()``. Each message is converted and JSON-encoded once per
  rollout (a state repeats the earlier ones); the state's JSON is joined from those pieces, the same text the
  SDK would write, and given to the SDK as a string, which it neither scans for media nor encodes again. A
  state holding anything besides messages and plain JSON values, or a base64 data URI anywhere, or a client
  with a ``mask`` function, takes the SDK's own path (as a dict) instead.
- **Routing functions fold into their node.** A conditional edge's routing function runs inside its source
  node; it gets no observation of its own (its input was the whole state again, its output one name). The
  route it chose is written on the node's observation as metadata ``langgraph_route`` (a list when a node has
  several conditional edges), straight onto the observation's OpenTelemetry span (the same attribute the SDK's
  ``update(metadata=...)`` writes, without its media scan and re-encoding; through ``update`` when the client
  masks). A routing function that raises leaves its error on the node's observation.
- **Chat prompts as text.** An LLM call's input (its messages, as the SDK converts them) is JSON-encoded once
  per message per rollout and joined, the same text the SDK would write; a call offering tools, a message
  holding a data URI or anything besides plain JSON data, or a masking client takes the SDK's own path.
- **LangGraph's bookkeeping is left out of the metadata**: ``langgraph_triggers``, ``langgraph_path``,
  ``langgraph_checkpoint_ns`` and ``checkpoint_ns``, and the ``graph:step:N`` / ``seq:step:N`` tags (the step
  is ``langgraph_step``; the nesting is the observation tree). ``langgraph_step``, ``langgraph_node`` and any
  other metadata or tags stay.

The handler's internals it relies on (its observations by run id, its run bookkeeping, the prompt path of its
``on_chat_model_start``) are reached through ``_langfuse_sdk``, which holds every use of the SDK's non-public parts.
"""

from __future__ import annotations

import json
from typing import Any
from uuid import UUID

from langchain_core.messages import BaseMessage
from langfuse import LangfuseOtelSpanAttributes
from langfuse.langchain import CallbackHandler
from langfuse.logger import langfuse_logger

from . import _langfuse_sdk as sdk
from ._langfuse_sdk import is_plain, plain_json

__all__ = ["LightStateHandler", "message_dict"]

BOOKKEEPING_KEYS = frozenset({"langgraph_triggers", "langgraph_path", "langgraph_checkpoint_ns", "checkpoint_ns"})
BOOKKEEPING_TAGS = ("graph:step:", "seq:step:")
NODE_TAG = "graph:step:"  # LangGraph tags each node's run with it (and only that run)
ROUTE_KEY = "langgraph_route"
ROUTE_ATTRIBUTE = f"{LangfuseOtelSpanAttributes.OBSERVATION_METADATA}.{ROUTE_KEY}"
_ON_LLM_ACTION = sdk.llm_action(CallbackHandler)
_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool", "function": "function"}


class LightStateHandler(CallbackHandler):  # type: ignore[misc]
    """Langfuse's ``CallbackHandler`` with compact, pre-encoded graph states and no routing observations.

    Args:
        text_states: give the SDK graph states as JSON text where that text is what the SDK would write (False:
            as dicts). Default: unless the client has a ``mask`` function, which expects the data itself.
        **kwargs: passed to ``langfuse.langchain.CallbackHandler`` (``public_key``, ``trace_context``).
    """

    def __init__(self, *, text_states: bool | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if text_states is None:
            text_states = not sdk.client_masks(sdk.handler_client(self))
        self.text_states = text_states
        self._messages: dict[int, tuple[Any, dict[str, Any], str | None]] = {}  # id -> (message, dict, JSON)
        self._prompts: dict[int, tuple[Any, str | None]] = {}  # id -> (message, the SDK's prompt dict as JSON)
        self._nodes: dict[UUID, list[Any]] = {}  # a LangGraph node's run id -> the routes its edges chose
        self._routing: dict[UUID, UUID] = {}  # a routing function's run id -> its node's run id

    # -- chains: nodes, routing functions, graphs -----------------------------------------------------

    def on_chain_start(self, serialized: Any, inputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                       tags: list[str] | None = None, metadata: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        parent_run_id = self._parent(parent_run_id)
        if tags and parent_run_id in self._nodes and _is_routing(tags):
            self._routing[run_id] = parent_run_id  # type: ignore[assignment]
            return None
        if tags and any(tag.startswith(NODE_TAG) for tag in tags):
            self._nodes[run_id] = []
        return super().on_chain_start(serialized, self._state(inputs), run_id=run_id, parent_run_id=parent_run_id,
                                      tags=_tags(tags), metadata=_metadata(metadata), **kwargs)

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> Any:
        node = self._routing.pop(run_id, None)
        if node is not None:
            self._route(node, outputs)
            return None
        self._nodes.pop(run_id, None)
        if "inputs" in kwargs:
            kwargs["inputs"] = self._state(kwargs["inputs"])
        return super().on_chain_end(self._state(outputs), run_id=run_id, **kwargs)

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> Any:
        if self._routing.pop(run_id, None) is not None:
            return None  # the error reaches the node's observation, which records it
        self._nodes.pop(run_id, None)
        return super().on_chain_error(error, run_id=run_id, **kwargs)

    # -- everything else that starts an observation: re-parented past routing functions, trimmed --------

    def on_chat_model_start(self, serialized: Any, messages: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                            tags: list[str] | None = None, metadata: dict[str, Any] | None = None,
                            **kwargs: Any) -> Any:
        parent_run_id = self._parent(parent_run_id)
        tags, metadata = _tags(tags), _metadata(metadata)
        text = self._prompt_text(messages, kwargs) if self.text_states and _ON_LLM_ACTION is not None else None
        if text is None:
            return super().on_chat_model_start(serialized, messages, run_id=run_id, parent_run_id=parent_run_id,
                                               tags=tags, metadata=metadata, **kwargs)
        # What the SDK's ``on_chat_model_start`` does, with the prompt given as the text it would have written.
        sdk.track_run(self, run_id=run_id, parent_run_id=parent_run_id, metadata=metadata)
        try:
            _ON_LLM_ACTION(self, serialized, run_id, text, parent_run_id, tags=tags, metadata=metadata, **kwargs)
        except Exception as exc:
            langfuse_logger.exception(exc)
        return None

    def on_llm_start(self, serialized: Any, prompts: Any, *, run_id: UUID, parent_run_id: UUID | None = None,
                     tags: list[str] | None = None, metadata: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        return super().on_llm_start(serialized, prompts, run_id=run_id, parent_run_id=self._parent(parent_run_id),
                                    tags=_tags(tags), metadata=_metadata(metadata), **kwargs)

    def on_tool_start(self, serialized: Any, input_str: str, *, run_id: UUID, parent_run_id: UUID | None = None,
                      tags: list[str] | None = None, metadata: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        return super().on_tool_start(serialized, input_str, run_id=run_id, parent_run_id=self._parent(parent_run_id),
                                     tags=_tags(tags), metadata=_metadata(metadata), **kwargs)

    def on_retriever_start(self, serialized: Any, query: str, *, run_id: UUID, parent_run_id: UUID | None = None,
                           tags: list[str] | None = None, metadata: dict[str, Any] | None = None,
                           **kwargs: Any) -> Any:
        return super().on_retriever_start(serialized, query, run_id=run_id, parent_run_id=self._parent(parent_run_id),
                                          tags=_tags(tags), metadata=_metadata(metadata), **kwargs)

    # -- helpers --------------------------------------------------------------------------------------

    def _parent(self, parent_run_id: UUID | None) -> UUID | None:
        """The run to nest under: a routing function's children go to its node (it has no observation)."""
        if parent_run_id is None:
            return None
        return self._routing.get(parent_run_id, parent_run_id)

    def _route(self, node: UUID, outputs: Any) -> None:
        """Write the route a routing function chose on its node's observation (``langgraph_route``)."""
        routes = self._nodes.get(node)
        observation = sdk.open_observation(self, node)
        if routes is None or observation is None:
            return
        routes.append(outputs)
        route = routes[0] if len(routes) == 1 else routes
        try:
            span = sdk.observation_span(observation) if self.text_states else None
            if span is not None and is_plain(route):
                span.set_attribute(ROUTE_ATTRIBUTE, sdk.metadata_json(route))
            else:  # a masking client (or an odd route): the SDK's own path, mask and media scan included
                observation.update(metadata={ROUTE_KEY: route})
        except Exception as exc:  # as the SDK's own callbacks do: logged (and counted), never failing the graph
            langfuse_logger.exception(exc)

    def _state(self, value: Any) -> Any:
        """A graph state (or update) as the SDK should get it: JSON text when possible, else compacted."""
        if self.text_states and type(value) is dict:
            text = self._state_text(value)
            if text is not None:
                return text
        if isinstance(value, dict):
            return {key: self._compact(item) for key, item in value.items()}
        return self._compact(value)

    def _compact(self, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], BaseMessage):
            return [self._message(m)[0] if isinstance(m, BaseMessage) else m for m in value]
        return self._message(value)[0] if isinstance(value, BaseMessage) else value

    def _state_text(self, state: dict[Any, Any]) -> str | None:
        """The JSON the SDK would write for the compacted state, joined from each message's cached JSON; None when
        the state holds something the SDK's media scan could change or that is not plain JSON data."""
        parts = []
        for key, value in state.items():
            if type(key) is not str:
                return None
            if isinstance(value, list) and value and isinstance(value[0], BaseMessage):
                pieces = [self._message(m)[1] if isinstance(m, BaseMessage) else plain_json(m) for m in value]
                if None in pieces:
                    return None
                text: str | None = "[" + ", ".join(pieces) + "]"  # type: ignore[arg-type]
            elif isinstance(value, BaseMessage):
                text = self._message(value)[1]
            else:
                text = plain_json(value)
            if text is None:
                return None
            parts.append(json.dumps(key) + ": " + text)
        return "{" + ", ".join(parts) + "}"

    def _prompt_text(self, messages: Any, kwargs: dict[str, Any]) -> str | None:
        """The JSON the SDK would write for a chat call's input, joined from each message's cached JSON; None
        when the call offers tools (the SDK appends them) or a message is not plain JSON data."""
        params = kwargs.get("invocation_params")
        if not isinstance(params, dict) or params.get("tools") or not isinstance(messages, list):
            return None
        pieces = []
        for batch in messages:
            if not isinstance(batch, list):
                return None
            for message in batch:
                cached = self._prompts.get(id(message))
                if cached is None or cached[0] is not message:
                    try:
                        converted = sdk.convert_message(self, message)
                    except Exception:  # an unknown message type: the SDK's path reports it
                        return None
                    cached = (message, plain_json(converted))
                    self._prompts[id(message)] = cached  # the message is kept: its id stays unique
                if cached[1] is None:
                    return None
                pieces.append(cached[1])
        return "[" + ", ".join(pieces) + "]"

    def _message(self, message: Any) -> tuple[dict[str, Any], str | None]:
        """A message's compact dict and its JSON (None if it holds a data URI), computed once per rollout."""
        cached = self._messages.get(id(message))
        if cached is not None and cached[0] is message:
            return cached[1], cached[2]
        converted = message_dict(message)
        text = plain_json(converted)
        self._messages[id(message)] = (message, converted, text)  # the message is kept: its id stays unique
        return converted, text


def message_dict(message: Any) -> dict[str, Any]:
    """A LangChain message as ``{"role", "content"}`` plus its tool calls, tool call id and name when set."""
    kind = message.type
    role = getattr(message, "role", None) if kind == "chat" else _ROLES.get(kind, kind)
    converted: dict[str, Any] = {"role": role, "content": message.content}
    for key in ("tool_calls", "invalid_tool_calls", "tool_call_id", "name"):
        value = getattr(message, key, None)
        if value:
            converted[key] = value
    return converted


def _is_routing(tags: list[str]) -> bool:
    """A node's routing function: a traced step after the node's own (``seq:step:1``) in the node's sequence;
    the steps in between are the node's channel writers, which LangGraph does not trace."""
    return any(tag.startswith("seq:step:") and tag != "seq:step:1" for tag in tags)


def _tags(tags: list[str] | None) -> list[str] | None:
    if not tags:
        return tags
    return [tag for tag in tags if not tag.startswith(BOOKKEEPING_TAGS)]


def _metadata(metadata: dict[str, Any] | None) -> dict[str, Any] | None:
    if not metadata or BOOKKEEPING_KEYS.isdisjoint(metadata):
        return metadata
    return {key: value for key, value in metadata.items() if key not in BOOKKEEPING_KEYS}
