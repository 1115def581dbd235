"""The Langfuse SDK's non-public parts ``art_plugins._langfuse_sdk`` relies on, checked against the installed SDK.

Each test names the part it checks: when one fails after a Langfuse upgrade, that part moved, and
``_langfuse_sdk`` (the one module that reaches it) needs updating. No server is needed: the client is made with
tracing on, pointing nowhere, and nothing is flushed.
"""

from __future__ import annotations

import inspect
import json
import math
import uuid
from collections.abc import Iterator
from typing import Any

import langfuse
import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langfuse import Langfuse
from langfuse._client.attributes import _serialize_metadata_value
from langfuse._utils.serializer import EventSerializer
from langfuse.langchain import CallbackHandler
from opentelemetry.sdk.trace import TracerProvider

from art_plugins import _langfuse_sdk as sdk

PLAIN = ["text", "naïve café ☕", "", 0, -7, 2**53 - 1, 3.25, -0.0, True, None, [1, "a", None], ("x", 2),
         {"k": [{"deep": {"er": ["v"]}}], "n": 1.5}, [], {}]
def _nested(depth: int) -> Any:
    return "too deep" if depth == 0 else [_nested(depth - 1)]


NOT_PLAIN = [2**53, -(2**60), math.nan, math.inf, "data:image/png;base64,iVBORw0KGgo=", {1: "int key"}, object(),
             _nested(20)]


@pytest.fixture(scope="module")
def client() -> Iterator[Langfuse]:
    provider = TracerProvider(shutdown_on_exit=False)
    client = Langfuse(public_key=f"pk-lf-{uuid.uuid4().hex[:8]}", secret_key="sk-lf-test",
                      base_url="http://127.0.0.1:9", tracer_provider=provider)
    yield client
    provider.shutdown()


def test_the_checked_version_is_named():
    # Not a failure when it differs: the tests below say whether the parts are still there.
    print(f"langfuse {langfuse.__version__} installed; _langfuse_sdk was checked against {sdk.CHECKED_VERSION}")
    assert sdk.CHECKED_VERSION.count(".") == 2


def test_client_resources_public_key_and_tracer_provider(client: Langfuse):
    assert sdk.client_public_key(client) == client._resources.public_key and sdk.client_public_key(client)
    assert sdk.client_tracer_provider(client) is client._resources.tracer_provider is not None


def test_client_mask(client: Langfuse):
    assert sdk.client_masks(client) is False
    masked = Langfuse(public_key=f"pk-lf-{uuid.uuid4().hex[:8]}", secret_key="sk-lf-test",
                      base_url="http://127.0.0.1:9", tracer_provider=TracerProvider(shutdown_on_exit=False),
                      mask=lambda *, data, **_: "MASKED" if isinstance(data, str) else data)
    failing = Langfuse(public_key=f"pk-lf-{uuid.uuid4().hex[:8]}", secret_key="sk-lf-test",
                       base_url="http://127.0.0.1:9", tracer_provider=TracerProvider(shutdown_on_exit=False),
                       mask=lambda *, data, **_: 1 / 0)
    try:
        assert sdk.client_masks(masked) is True
        assert sdk.masked(masked, "my card 4111") == "MASKED" and sdk.masked(client, "my card 4111") == "my card 4111"
        assert sdk.masked(failing, "my card 4111") == "<fully masked due to failed mask function>"
    finally:
        masked.shutdown()
        failing.shutdown()
    assert sdk.client_masks(object()) is True  # unreadable counts as masking: the SDK's own path is taken


def test_callback_handler_internals(client: Langfuse):
    handler = CallbackHandler(public_key=sdk.client_public_key(client))
    # _langfuse_client: a client over the same resources (the SDK keeps one set per public key)
    assert sdk.handler_client(handler)._resources is client._resources
    assert isinstance(handler._runs, dict)  # _runs: open observations by run id
    action = sdk.llm_action(CallbackHandler)  # __on_llm_action (name-mangled), taking the prompt as given
    assert action is not None
    assert list(inspect.signature(action).parameters)[:5] == ["self", "serialized", "run_id", "prompts",
                                                              "parent_run_id"]
    assert list(inspect.signature(CallbackHandler._track_run).parameters) == ["self", "run_id", "parent_run_id",
                                                                              "metadata"]
    assert sdk.convert_message(handler, HumanMessage(content="hi")) == {"role": "user", "content": "hi"}
    assert sdk.convert_message(handler, AIMessage(content="ok"))["role"] == "assistant"


def test_observation_otel_span(client: Langfuse):
    observation = client.start_observation(name="probe", as_type="span")
    try:
        span = sdk.observation_span(observation)
        assert span is not None and span.is_recording() and hasattr(span, "set_attribute")
        assert sdk.open_observation(CallbackHandler(public_key=sdk.client_public_key(client)), uuid.uuid4()) is None
    finally:
        observation.end()


@pytest.mark.parametrize("value", PLAIN, ids=repr)
def test_plain_values_encode_as_the_sdk_encodes_them(value: Any):
    assert sdk.is_plain(value)
    assert sdk.plain_json(value) == json.dumps(value, cls=EventSerializer)  # observation input and output
    assert sdk.metadata_json(value) == _serialize_metadata_value(value)  # one metadata value


@pytest.mark.parametrize("value", NOT_PLAIN, ids=lambda v: type(v).__name__)
def test_values_the_sdk_rewrites_are_left_to_it(value: Any):
    assert not sdk.is_plain(value) and sdk.plain_json(value) is None
