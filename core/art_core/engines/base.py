"""The engine contract: what the gateway asks of an inference engine.

An engine turns prompt token ids into sampled completions, token-exact, and serves the LoRA adapter of
the latest checkpoint. The gateway renders chat templates and parses tool calls; the engine sees only
tokens. Two implementations: ``engines/transformers.py`` (in process, CPU or GPU) and ``engines/vllm.py``
(a ``vllm serve`` subprocess). A test engine can be any object with these methods (it is a Protocol).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

__all__ = ["Engine", "EngineOutput", "SamplingParams", "TokenDelta", "routing_key", "stream_tokens"]

routing_key: ContextVar[str | None] = ContextVar("art_routing_key", default=None)
"""The rollout the request being served belongs to (None: none), for engines that spread requests over
replicas and keep a rollout's calls on one of them (``backends/ray``'s router). The gateway sets it per
request; each request runs in its own task, so the value never leaks into another request. Engines that
serve from one place ignore it."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Mirrors the OpenAI fields the gateway accepts."""

    max_tokens: int = 256
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    """Strings that end the completion; the stop string itself is not returned (OpenAI's behaviour)."""
    seed: int | None = None
    n: int = 1
    """Completions for this prompt."""
    top_logprobs: int = 0
    """Alternatives to report per position (0: only the sampled token's logprob)."""
    json_schema: dict[str, Any] | None = None
    """Constrain output to this JSON schema, where the engine supports it."""
    grammar: str | None = None
    """Constrain output to this llguidance Lark grammar (``%json {...}`` embeds a JSON schema), where the
    engine supports it; the gateway uses it to enforce ``tool_choice``. At most one of this and ``json_schema``."""


@dataclass(frozen=True)
class EngineOutput:
    """One sampled completion, token-exact."""

    token_ids: list[int]
    """Sampled ids, including the stop token when generation ended on one."""
    logprobs: list[float]
    """The model's log-probability of each sampled token (raw distribution, before temperature/top-p)."""
    finish_reason: Literal["stop", "length"]
    top_logprobs: list[dict[int, float]] | None = None
    """Per position, the most likely alternatives (token id -> logprob), when asked for."""
    adapter_step: int = 0
    """Checkpoint step of the adapter that produced it (0: the base model)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent queued and generating."""


@dataclass(frozen=True)
class TokenDelta:
    """Tokens of one choice, sent as soon as they are sampled (``Engine.stream``)."""

    choice: int
    """Which of the request's ``n`` completions the tokens extend (0-based)."""
    token_ids: list[int]
    """The ids just sampled (usually one)."""
    logprobs: list[float]
    """Raw log-probability of each of them (same length as ``token_ids``)."""
    top_logprobs: list[dict[int, float]] | None = None
    """Per new position, the most likely alternatives, when asked for."""
    finish_reason: Literal["stop", "length"] | None = None
    """Set on the choice's last delta: the completion ended."""
    adapter_step: int = 0
    """Checkpoint step of the adapter sampling this completion."""


@runtime_checkable
class Engine(Protocol):
    """What the gateway needs from an inference engine."""

    tokenizer: Any
    """A Hugging Face tokenizer with the chat template the model was trained with."""

    @property
    def adapter_step(self) -> int:
        """Checkpoint step being served now (0: the base model)."""
        ...

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams) -> list[EngineOutput]:
        """Sample ``params.n`` completions of one prompt. Concurrent calls may be batched together."""
        ...

    def stream(self, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenDelta]:
        """Like ``generate``, but each choice's tokens come out as they are sampled.

        Every choice ends with a delta whose ``finish_reason`` is set. Closing the iterator early (or
        cancelling the task reading it) stops the request: its batch rows are freed at the next step.
        """
        ...

    async def load_adapter(self, path: Path, step: int) -> None:
        """Serve the PEFT adapter in ``path`` as checkpoint ``step`` from the next request on."""
        ...

    async def pause(self) -> None:
        """Finish in-flight requests, then hold new ones (they wait, they do not fail) until resume()."""
        ...

    async def resume(self) -> None:
        ...

    async def health(self) -> dict[str, Any]:
        ...

    async def aclose(self) -> None:
        ...


async def stream_tokens(engine: Any, prompt_token_ids: list[int], params: SamplingParams
                        ) -> AsyncIterator[TokenDelta]:
    """``engine.stream(...)``, or, for an engine that only has ``generate``, its outputs as one delta per choice.

    Test engines written as a plain ``generate`` function keep working: their outputs come as one delta per
    token once generation is over (not live).
    """
    stream = getattr(engine, "stream", None)
    if stream is not None:
        async for delta in stream(prompt_token_ids, params):
            yield delta
        return
    for index, out in enumerate(await engine.generate(prompt_token_ids, params)):
        last = len(out.token_ids) - 1
        if last < 0 or len(out.logprobs) != len(out.token_ids):  # nothing to split: the caller checks the rest
            yield TokenDelta(index, list(out.token_ids), list(out.logprobs), out.top_logprobs, out.finish_reason,
                             out.adapter_step)
            continue
        for pos, (token_id, logprob) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            top = out.top_logprobs[pos : pos + 1] if out.top_logprobs is not None else None
            yield TokenDelta(index, [token_id], [logprob], top, out.finish_reason if pos == last else None,
                             out.adapter_step)


def check_adapter_path(path: Path) -> Path:
    """An adapter folder must exist and hold a PEFT config; say which when it does not."""
    from ..errors import CheckpointError

    if not (path / "adapter_config.json").is_file():
        raise CheckpointError(f"{path} is not a PEFT adapter folder (no adapter_config.json)")
    return path
