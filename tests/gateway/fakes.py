"""Test doubles for the gateway's HTTP-layer tests (imported as ``fakes``: tests/ has no packages)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from art_core.engines.base import EngineOutput, SamplingParams

Reply = str | Callable[[list[int], SamplingParams, int], str]

TOOL_REPLY = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class FakeEngine:
    """Stands in for the model only in HTTP-layer tests.

    Returns canned text encoded with the real tokenizer, plus the end-of-turn token (finish "stop"), or
    cut at ``max_tokens`` (finish "length"). Logprobs are -0.5, -0.51, -0.52...; with ``top_logprobs``
    each position lists the sampled token and token ids 100, 101... one nat apart.

    Args:
        tokenizer: the real tokenizer (its chat template renders the prompts).
        reply: the text, or ``f(prompt_ids, params, choice_index) -> text``.
        delay: seconds to sleep per call, or a function returning them.

    Attributes:
        gate: when set to an ``asyncio.Event``, each call waits inside the engine until the test sets it (holds
            "a call in progress" for as long as the test needs, with no guess at how long anything takes).
        health_gate: the same for ``health()``: it waits until the test sets it (an engine whose own health
            check is stuck, as a saturated server's is).
    """

    def __init__(
        self, tokenizer: Any, reply: Reply = "Hello there! How can I help?", delay: float | Callable[[], float] = 0.0
    ) -> None:
        self.tokenizer = tokenizer
        self.reply = reply
        self.delay = delay
        self.step = 0
        self.calls: list[tuple[list[int], SamplingParams]] = []
        self.paused = False
        self.fail_with: Exception | None = None
        self.gate: asyncio.Event | None = None
        self.health_gate: asyncio.Event | None = None
        self.health_calls = 0

    @property
    def adapter_step(self) -> int:
        return self.step

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> list[EngineOutput]:
        if self.paused:
            raise AssertionError("generate() called while the engine is paused")
        self.calls.append((list(prompt_token_ids), params))
        delay = self.delay() if callable(self.delay) else self.delay
        if delay:
            await asyncio.sleep(delay)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_with is not None:
            raise self.fail_with
        outputs = []
        for i in range(params.n):
            text = self.reply(prompt_token_ids, params, i) if callable(self.reply) else self.reply
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) >= params.max_tokens:
                ids, finish = ids[: params.max_tokens], "length"
            else:
                ids, finish = ids + [self.tokenizer.eos_token_id], "stop"
            logprobs = [-0.5 - 0.01 * k for k in range(len(ids))]
            top = None
            if params.top_logprobs:
                top = [{tid: lp, **{100 + j: lp - 1.0 - j for j in range(params.top_logprobs - 1)}}
                       for tid, lp in zip(ids, logprobs)]
            outputs.append(EngineOutput(ids, logprobs, finish, top, self.step, {"queue": 0.0, "generate": delay}))
        return outputs

    async def load_adapter(self, path: Path, step: int) -> None:
        self.step = step

    async def pause(self) -> None:
        self.paused = True

    async def resume(self) -> None:
        self.paused = False

    async def health(self) -> dict[str, Any]:
        self.health_calls += 1
        if self.health_gate is not None:
            await self.health_gate.wait()
        return {"ok": True}

    async def aclose(self) -> None:
        pass


def random_delay(low: float = 0.0, high: float = 0.02, seed: int = 0) -> Callable[[], float]:
    """Seconds to sleep, drawn from a seeded generator."""
    rng = random.Random(seed)
    return lambda: rng.uniform(low, high)


def post_scope(path: str, body: bytes, *, port: int) -> dict[str, Any]:
    """The ASGI scope of ``POST path`` with a JSON ``body``, for tests that call the app with their own
    ``receive`` and ``send`` (a client that stops reading, or leaves at a chosen chunk)."""
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": b"", "root_path": "", "query_string": b"",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", port)}


def receive_body(body: bytes, *, leave: asyncio.Event | None = None) -> Callable[[], Any]:
    """An ASGI ``receive`` that delivers ``body`` once, then reports a disconnect when ``leave`` is set
    (None: the client never leaves)."""
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await (leave or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    return receive
