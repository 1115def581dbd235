"""One completion, from a validated request to the recorded answer: the pipeline both API routes call.

    route (chat.py, responses.py): its API's request -> ChatCompletionRequest
    here:  model name checked -> sampling parameters -> prompt ids (chat template) -> engine.stream
           -> per token: text (stop strings held back), tool-call blocks (held until they parse) -> events
           -> at the end of every choice: whole text parsed -> records (on disk) -> metrics -> Done events
    route: events -> its API's JSON object or server-sent events

Each token leaves as soon as it is sampled (``Completion.events``); a route that answers with one JSON
object just collects the events (``Completion.answers``). Either way the records are written, token-exact,
before the last event goes out. A completion stopped early (the client went away, the task was
cancelled) is recorded with the tokens sampled so far and ``finish_reason="cancelled"``, and its engine
rows stop at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from ..engines.base import SamplingParams, TokenDelta, stream_tokens
from ..errors import ConstraintError, LifecycleError
from .errors import APIError
from .records import ExchangeRecord
from .schemas import (
    ChatCompletionRequest,
    FunctionCallOut,
    NamedToolChoice,
    TokenLogprob,
    ToolCallOut,
    TopLogprob,
)
from .served import check_model
from .state import GatewayState
from .tokens import Detokenizer, TextStream, render_prompt
from .tool_calls import ContentDelta, ToolCallStream, format_tool_call_id, hermes_tool_call_grammar, parse_tool_calls

__all__ = ["Answer", "Completion", "Done", "TextDelta", "ToolCallDelta", "json_body", "logprob_entries",
           "new_request_id", "sampling_params", "validate_chat"]

logger = logging.getLogger(__name__)

Endpoint = Literal["chat.completions", "responses"]


# --- what a route gets --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Delta:
    index: int
    """The choice it belongs to."""
    logprobs: list[TokenLogprob] | None
    """Entries of the tokens whose text goes out with it (None: the client did not ask for logprobs)."""


@dataclass(frozen=True)
class TextDelta(_Delta):
    """More content of choice ``index``."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta(_Delta):
    """One whole tool call of choice ``index``, sent once its block has parsed."""

    call: ToolCallOut
    call_index: int
    """Position among the choice's calls (OpenAI's ``tool_calls[i].index``)."""


@dataclass(frozen=True)
class Answer:
    """One finished choice: what the client is answered, as recorded."""

    index: int
    content: str | None
    """Text outside tool-call markup; None when the model only called tools."""
    tool_calls: list[ToolCallOut]
    finish_reason: str
    """``stop``, ``length`` or ``tool_calls``."""
    logprobs: list[TokenLogprob] | None
    """Every visible token's entry, when asked for."""
    completion_tokens: int
    adapter_step: int


@dataclass(frozen=True)
class Done:
    """Choice ``answer.index`` has ended; its record is on disk."""

    answer: Answer
    logprobs: list[TokenLogprob] | None
    """Entries of tokens no delta carried yet (e.g. the end-of-turn token's neighbours), when asked for."""


Event = TextDelta | ToolCallDelta | Done


# --- the request --------------------------------------------------------------------------------------


async def json_body(request: Request) -> dict[str, Any]:
    """The request body as a JSON object.

    Raises:
        APIError: 400 when it is not valid JSON, or not an object.
    """
    body = await request.body()
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise APIError(
            400, f"the request body is not valid JSON ({exc}): send a JSON object with Content-Type: application/json",
            code="invalid_json",
        ) from exc
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    return data


def validate_chat(raw: dict[str, Any]) -> ChatCompletionRequest:
    """``raw`` as a chat completions request; the app turns a failure into one 400 naming every bad field."""
    try:
        return ChatCompletionRequest.model_validate(raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from exc


# --- the pipeline -------------------------------------------------------------------------------------


@dataclass
class _Choice:
    """One choice being sampled: its tokens so far, and its text and tool calls as streamed."""

    index: int
    text: TextStream | None
    """Incremental text (only when the route streams)."""
    parser: ToolCallStream | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)
    finish: str | None = None
    adapter_step: int = 0
    pending: list[TokenLogprob] = field(default_factory=list)
    """Logprob entries of tokens whose text has not gone out yet."""
    call_ids: list[str] = field(default_factory=list)
    """Ids of the tool calls already streamed (the record keeps them)."""
    first_token_at: float = 0.0
    last_token_at: float = 0.0


class Completion:
    """One request's completion: rendered at construction, sampled and recorded by ``events()``/``answers()``.

    Args:
        state: the app's state.
        body: the request as chat completions (the Responses route translates its request first).
        raw: the body as received (kept in the record).
        endpoint: the API the request came through.
        rollout_id: the rollout it belongs to, if any.
        caller: the ``X-Art-Caller`` label, if any.
        seed: the ``X-Art-Seed`` header's seed, used when the body names no ``seed``.
        request_id: the response's id (``chatcmpl-...``, ``resp_...``).
        tools: the chat-format tool schemas as sent (default: ``raw["tools"]``).

    Raises:
        APIError: the model name, a sampling parameter or the conversation is refused (4xx).
    """

    def __init__(self, state: GatewayState, body: ChatCompletionRequest, raw: dict[str, Any], *, endpoint: Endpoint,
                 rollout_id: str | None, caller: str | None, request_id: str,
                 tools: list[dict[str, Any]] | None = None, seed: int | None = None) -> None:
        self.started = time.perf_counter()
        self.created = time.time()
        if body.model_extra:
            logger.debug("ignoring unknown request fields: %s", sorted(body.model_extra))
        check_model(body.model, state.settings, state.engine.adapter_step)
        self.state, self.body, self.raw, self.endpoint = state, body, raw, endpoint
        self.rollout_id, self.caller, self.request_id = rollout_id, caller, request_id
        self.params = sampling_params(body, state, seed=seed)
        # The template sees the tools unless tool_choice is "none"; then no calls are parsed either.
        offered = bool(body.tools) and body.tool_choice != "none"
        self.tools = (tools if tools is not None else raw["tools"]) if offered else None
        self.tool_names = [t.function.name for t in body.tools or []] if offered else None
        self.messages = [m.model_dump(exclude_none=True) for m in body.messages]  # dumped once: template and record
        self.prompt_ids = render_prompt(state.engine.tokenizer, self.messages, self.tools,
                                        encoder=state.prompt_encoder, template=state.chat_template)
        self.top_n = body.top_logprobs or 0 if body.logprobs else -1  # -1: no logprobs for the client

    async def answers(self) -> list[Answer]:
        """Sample every choice to its end and return the answers (records written), in choice order.

        ``events`` without the streamed text and tool calls, as one loop over the engine's tokens in the
        request's own task: the pump's task and queue and the generator layers every token passes through
        there (about a quarter of the gateway's own time per call, benchmark part (c)) would add nothing.
        Records, errors and cancellation are the same.

        Raises:
            APIError: the engine refused the request (400), is unavailable (503) or failed (500).
        """
        with self.state.control.answering(self.rollout_id):  # counted until answered (GET /rollouts/{id}/status)
            state, params = self.state, self.params
            choices = [_Choice(i, None, None) for i in range(params.n)]
            tokens = stream_tokens(state.engine, self.prompt_ids, params)
            waited, cancelled = 0.0, False
            self._engine_called = 0.0
            try:
                async with state.control.admitted() as waited:
                    self._engine_called = time.perf_counter()
                    try:
                        async for delta in tokens:
                            _take(choices, delta, params.n, time.perf_counter())
                    except (APIError, asyncio.CancelledError):
                        raise
                    except Exception as exc:
                        raise _engine_failure(exc, params) from exc
            except asyncio.CancelledError:
                # Stopped from outside: the client went away, or the task was cancelled. Recorded below, unless
                # every choice had already finished.
                cancelled = any(c.finish is None for c in choices)
                raise
            finally:
                await tokens.aclose()  # type: ignore[attr-defined]  # stops the engine's rows on an early stop
                if cancelled:
                    self._record_cancelled(choices, waited)
            unfinished = [c.index for c in choices if c.finish is None]
            if unfinished:
                raise _contract_broken(f"ended without finishing completion(s) {unfinished}")
            return [self._record(c, waited) for c in choices]

    async def events(self) -> AsyncIterator[Event]:
        """Sample, yielding each choice's text and tool calls as they come, then a ``Done`` per choice.

        The ``Done`` events come after every choice has ended and every record has been written. If the
        iteration stops early (the reader closed it, or its task was cancelled), each unfinished choice is
        recorded with the tokens sampled so far and ``finish_reason="cancelled"``.

        Raises:
            APIError: the engine refused the request (400), is unavailable (503) or failed (500).
        """
        with self.state.control.answering(self.rollout_id):  # counted until answered (GET /rollouts/{id}/status)
            state, params = self.state, self.params
            choices = [_Choice(i, TextStream(state.detokenizer, params.stop),
                               ToolCallStream(tool_names=self.tool_names) if self.tool_names is not None else None)
                       for i in range(params.n)]
            pump = _EnginePump(state, _engine_errors(stream_tokens(state.engine, self.prompt_ids, params), params))
            cancelled = False
            try:
                async for delta, arrived in pump:
                    choice = _take(choices, delta, params.n, arrived)
                    for event in self._live_events(choice, delta):
                        yield event
                self._engine_called = pump.engine_called
                unfinished = [c.index for c in choices if c.finish is None]
                if unfinished:
                    raise _contract_broken(f"ended without finishing completion(s) {unfinished}")
                # The held-back text and calls first (a call's id is given when it is streamed), then the records.
                tails = [self._tail(c) for c in choices]
                answers = [self._record(c, pump.waited) for c in choices]
                for choice, answer, tail in zip(choices, answers, tails, strict=True):
                    for event in tail:
                        yield event
                    yield Done(answer, self._flush(choice) if self.top_n >= 0 else None)
            except (GeneratorExit, asyncio.CancelledError):
                # Stopped from outside: the client went away, or the task was cancelled. Recorded below, unless
                # every choice had already been recorded.
                cancelled = any(c.finish is None for c in choices)
                raise
            finally:
                await pump.stop()  # stops the engine's rows when the iteration ended early
                if cancelled:
                    self._engine_called = pump.engine_called
                    for delta, arrived in pump.left_over():  # sampled but not yet read: the record keeps them
                        with contextlib.suppress(APIError):  # a broken delta is logged by _take and left out
                            _take(choices, delta, params.n, arrived)
                    self._record_cancelled(choices, pump.waited)

    # --- per token ---

    def _live_events(self, choice: _Choice, delta: TokenDelta) -> list[Event]:
        assert choice.text is not None
        if self.top_n >= 0:
            choice.pending += self._entries(delta.token_ids, delta.logprobs, delta.top_logprobs)
        piece = choice.text.feed(delta.token_ids)
        return self._parsed(choice, piece) if piece else []

    def _tail(self, choice: _Choice) -> list[Event]:
        """The events left at a choice's end: the rest of its text, and what the tool-call parser held."""
        assert choice.text is not None
        events = self._parsed(choice, choice.text.rest(self._final_text(choice)))
        if choice.parser is not None:
            events += self._converted(choice, choice.parser.finish())
        return events

    def _parsed(self, choice: _Choice, piece: str) -> list[Event]:
        if choice.parser is None:
            return [TextDelta(choice.index, self._flush(choice), piece)] if piece else []
        return self._converted(choice, choice.parser.feed(piece))

    def _converted(self, choice: _Choice, events: list[Any]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if isinstance(event, ContentDelta):
                out.append(TextDelta(choice.index, self._flush(choice), event.text))
            else:
                choice.call_ids.append(event.id)
                call = ToolCallOut(id=event.id, function=FunctionCallOut(name=event.name, arguments=event.arguments))
                out.append(ToolCallDelta(choice.index, self._flush(choice), call, event.index))
        return out

    def _flush(self, choice: _Choice) -> list[TokenLogprob] | None:
        if self.top_n < 0:
            return None
        entries, choice.pending = choice.pending, []
        return entries

    # --- at the end ---

    def _final_text(self, choice: _Choice) -> str:
        text = self.state.detokenizer.decode(choice.token_ids)
        cuts = [text.find(s) for s in self.params.stop if s in text]
        return text[: min(cuts)] if cuts else text

    def _answer(self, choice: _Choice) -> tuple[Answer, int]:
        """The choice's answer, parsed from its whole text; and how many tool-call blocks failed to parse."""
        text = self._final_text(choice)
        finish = choice.finish or "cancelled"
        # The engine should stop on stop strings itself; cutting keeps OpenAI's contract if it did not.
        if finish != "cancelled" and any(s in self.state.detokenizer.decode(choice.token_ids) for s in self.params.stop):
            finish = "stop"
        content: str | None = text
        calls: list[ToolCallOut] = []
        errors = 0
        if self.tool_names is not None:
            parsed = parse_tool_calls(text, tool_names=self.tool_names)
            content, errors = parsed.content, parsed.parse_errors
            ids = choice.call_ids + [format_tool_call_id() for _ in parsed.tool_calls[len(choice.call_ids):]]
            calls = [ToolCallOut(id=call_id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                     for call_id, c in zip(ids, parsed.tool_calls, strict=False)]
            if calls and finish == "stop":  # a cut-off completion still says "length"
                finish = "tool_calls"
        logprobs = (self._entries(choice.token_ids, choice.logprobs, choice.top or None)
                    if self.top_n >= 0 else None)
        return Answer(choice.index, content, calls, finish, logprobs, len(choice.token_ids), choice.adapter_step), errors

    def _record(self, choice: _Choice, waited: float) -> Answer:
        """Write the choice's record (flushed to disk) and count it; returns its answer."""
        answer, errors = self._answer(choice)
        reply: dict[str, Any] = {"role": "assistant", "content": answer.content}
        if answer.tool_calls:
            reply["tool_calls"] = [c.model_dump() for c in answer.tool_calls]
        state = self.state
        # Constructed without validating again: every value was made and typed by the pipeline (validation
        # would also deep-copy the request and messages, per call).
        state.records.add(ExchangeRecord.model_construct(
            request_id=self.request_id, choice_index=choice.index, rollout_id=self.rollout_id, created=self.created,
            endpoint=self.endpoint, model=self.body.model, adapter_step=choice.adapter_step, request=self.raw,
            prompt_token_ids=self.prompt_ids, completion_token_ids=list(choice.token_ids),
            logprobs=list(choice.logprobs), finish_reason=answer.finish_reason,
            timings=self._timings(choice, waited),
            messages=self.messages, tools=self.tools or [], reply={k: v for k, v in reply.items() if v is not None},
            caller=self.caller,
        ))
        metrics = state.metrics
        metrics.records_written += 1
        metrics.completion_tokens += len(choice.token_ids)
        metrics.tool_call_parse_errors += errors
        metrics.tool_calls += len(answer.tool_calls)
        if choice.index == 0:
            metrics.completions += 1
            metrics.prompt_tokens += len(self.prompt_ids)
        return answer

    def _timings(self, choice: _Choice, waited: float) -> dict[str, float]:
        now = time.perf_counter()
        first = choice.first_token_at or now
        return {"wait": waited, "queue": max(first - (self._engine_called or first), 0.0),
                "generate": (choice.last_token_at or first) - first, "total": now - self.started}

    def _record_cancelled(self, choices: list[_Choice], waited: float) -> None:
        """The request stopped early: every choice is recorded as it stands (never dropped silently)."""
        for choice in choices:
            choice.finish = choice.finish or "cancelled"
        self.state.metrics.completions_cancelled += 1
        logger.info("request %s (rollout %s) stopped early; recorded with the tokens sampled so far (%s)",
                    self.request_id, self.rollout_id, [len(c.token_ids) for c in choices])
        for choice in choices:
            try:
                self._record(choice, waited)
            except Exception:  # the record is the point: say loudly that it could not be written
                logger.exception("could not record cancelled choice %d of %s", choice.index, self.request_id)

    def _entries(self, token_ids: list[int], logprobs: list[float],
                 top: list[dict[int, float]] | None) -> list[TokenLogprob]:
        return logprob_entries(token_ids, logprobs, top, self.state.detokenizer, max(self.top_n, 0))


def sampling_params(body: ChatCompletionRequest, state: GatewayState, *, seed: int | None = None) -> SamplingParams:
    """The engine's sampling parameters for a chat request.

    Args:
        body: the request.
        state: the app's state (token limits).
        seed: the seed to sample with when the body names none (the ``X-Art-Seed`` header).

    Raises:
        APIError: 400 for a token limit above the gateway's, or ``tool_choice`` combined with ``response_format``.
    """
    limit = state.settings.max_tokens_limit
    asked, name = (body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens else (
        body.max_tokens, "max_tokens")
    if asked is not None and asked > limit:
        raise APIError(
            400, f"{name} is {asked}, above this gateway's limit of {limit}: ask for at most {limit}",
            param=name, code="max_tokens_too_large",
        )
    json_schema, grammar = None, None
    if body.tools and (body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice)):
        if body.response_format is not None and body.response_format.type != "text":
            raise APIError(400, "tool_choice 'required' or a named function cannot be combined with response_format "
                           f"{body.response_format.type!r}: the reply is a tool call; drop one of the two",
                           param="tool_choice", code="invalid_request")
        # Enforced by constrained decoding: the completion is Hermes tool-call blocks, as the template teaches.
        tools = [(t.function.name, t.function.parameters) for t in body.tools]
        if isinstance(body.tool_choice, NamedToolChoice):
            tools = [t for t in tools if t[0] == body.tool_choice.function.name]
        grammar = hermes_tool_call_grammar(tools, multiple=body.tool_choice == "required")
    elif body.response_format is not None and body.response_format.type == "json_object":
        json_schema = {"type": "object"}  # "any JSON object": engines that constrain output get the same rule
    elif body.response_format is not None and body.response_format.json_schema is not None:
        json_schema = body.response_format.json_schema.schema_
    return SamplingParams(
        max_tokens=asked if asked is not None else min(state.settings.default_max_tokens, limit),
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        stop=body.stop_strings(),
        seed=body.seed if body.seed is not None else seed,
        n=body.n or 1,
        top_logprobs=body.top_logprobs or 0,
        json_schema=json_schema,
        grammar=grammar,
    )


def logprob_entries(token_ids: list[int], logprobs: list[float], top: list[dict[int, float]] | None,
                    detokenizer: Detokenizer, top_n: int) -> list[TokenLogprob]:
    """OpenAI's per-token logprobs for the tokens of the text (special tokens such as end-of-turn left out)."""
    entries = []
    for pos, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
        if token_id in detokenizer.skip_ids:
            continue
        alternatives: list[TopLogprob] = []
        if top_n and top is not None and pos < len(top):
            best = sorted(top[pos].items(), key=lambda kv: kv[1], reverse=True)[:top_n]
            alternatives = [TopLogprob(token=_text(t, detokenizer), logprob=_finite(lp),
                                       bytes=list(detokenizer.token_bytes(t))) for t, lp in best]
        raw = detokenizer.token_bytes(token_id)
        entries.append(TokenLogprob(token=raw.decode("utf-8", errors="replace"), logprob=_finite(logprob),
                                    bytes=list(raw), top_logprobs=alternatives))
    return entries


class _EnginePump:
    """Reads the engine's tokens in a task of its own, so the request leaves the engine (and stops counting
    in flight) when generation ends, not when a slow client has read the last chunk: a slow reader cannot hold
    a training pause. Iterate it for ``(delta, arrival time)``; engine errors are raised there.
    """

    _END = object()

    def __init__(self, state: GatewayState, tokens: AsyncIterator[TokenDelta]) -> None:
        self.waited = 0.0
        """Seconds the request was held by a training pause."""
        self.engine_called = 0.0
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._tokens = tokens
        self._task = asyncio.create_task(self._run(state))

    async def _run(self, state: GatewayState) -> None:
        try:
            async with state.control.admitted() as self.waited:
                self.engine_called = time.perf_counter()
                async for delta in self._tokens:
                    self._queue.put_nowait((delta, time.perf_counter()))
            self._queue.put_nowait(self._END)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the reader, which raises it in the request's task
            self._queue.put_nowait(exc)
        finally:
            await self._tokens.aclose()  # type: ignore[attr-defined]

    def __aiter__(self) -> _EnginePump:
        return self

    async def __anext__(self) -> tuple[TokenDelta, float]:
        item = await self._queue.get()
        if item is self._END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        delta_at: tuple[TokenDelta, float] = item
        return delta_at

    async def stop(self) -> None:
        """Cancel the engine's side if it is still running, and wait until its rows are released."""
        if not self._task.done():
            self._task.cancel()
            await asyncio.wait([self._task])

    def left_over(self) -> list[tuple[TokenDelta, float]]:
        """The tokens sampled but not yet read (after ``stop``)."""
        items = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, tuple):
                items.append(item)
        return items


# --- helpers ------------------------------------------------------------------------------------------


def _take(choices: list[_Choice], delta: TokenDelta, n: int, arrived: float) -> _Choice:
    """Add ``delta`` to its choice; the engine keeps its contract, or the request fails loudly."""
    if not 0 <= delta.choice < n:
        raise _contract_broken(f"sent tokens for completion {delta.choice} of n={n}")
    if len(delta.logprobs) != len(delta.token_ids):
        raise _contract_broken(f"sent {len(delta.token_ids)} tokens but {len(delta.logprobs)} logprobs")
    choice = choices[delta.choice]
    if choice.finish is not None:
        raise _contract_broken(f"sent tokens for completion {delta.choice} after it finished")
    choice.token_ids += delta.token_ids
    choice.logprobs += delta.logprobs
    if delta.top_logprobs is not None:
        choice.top += delta.top_logprobs
    choice.adapter_step = delta.adapter_step
    choice.finish = delta.finish_reason
    choice.last_token_at = arrived
    choice.first_token_at = choice.first_token_at or choice.last_token_at
    return choice


def _contract_broken(problem: str) -> APIError:
    # A bad record would poison training: fail the request instead.
    logger.error("engine broke its contract: %s", problem)
    return APIError(500, f"the engine {problem}", code="engine_error")


async def _engine_errors(tokens: AsyncIterator[TokenDelta], params: SamplingParams) -> AsyncIterator[TokenDelta]:
    """The engine's tokens, its failures mapped to the API's errors (400, 503, 500)."""
    try:
        async for delta in tokens:
            yield delta
    except (APIError, GeneratorExit, asyncio.CancelledError):
        raise
    except Exception as exc:
        raise _engine_failure(exc, params) from exc
    finally:
        await tokens.aclose()  # type: ignore[attr-defined]


def _engine_failure(exc: Exception, params: SamplingParams) -> APIError:
    """The API's error for an engine failure: 400 (a schema it cannot enforce), 503 (unavailable) or 500."""
    if isinstance(exc, ConstraintError):
        return APIError(400, f"{exc}: send a JSON schema (response_format, tool parameters) this engine can enforce",
                        param="response_format" if params.grammar is None else "tools", code="unsupported_schema")
    if isinstance(exc, LifecycleError):
        logger.warning("engine unavailable: %s", exc)
        return APIError(503, f"the engine is not available: {exc}", code="engine_unavailable")
    logger.exception("engine.generate failed")
    return APIError(500, f"the engine failed: {type(exc).__name__}: {exc}", code="engine_error")


def _text(token_id: int, detokenizer: Detokenizer) -> str:
    return detokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def _finite(logprob: float) -> float:
    # JSON has no -Infinity; OpenAI reports "practically impossible" as -9999.0. Records keep the raw value.
    return logprob if math.isfinite(logprob) else -9999.0


def new_request_id(prefix: str) -> str:
    """A fresh response id: ``prefix`` and 32 random hex digits."""
    return prefix + os.urandom(16).hex()  # as random as uuid4().hex, without building a UUID
