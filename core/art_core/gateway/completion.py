"""One completion, from a validated call to the recorded answer: the pipeline both API routes call.

    route (chat.py, responses.py), with parsing.py: its API's request -> CompletionInput (model name and
           token limit checked, sampling parameters made)
    here:  prompt ids (chat template) -> admitted (held while training pauses) -> engine.stream
           -> per token: text (stop strings held back), tool-call blocks (held until they parse) -> events
           -> at the end of every choice: whole text parsed -> records (on disk) -> metrics -> Done events
    route: events -> its API's JSON object or server-sent events

Each token leaves as soon as it is sampled (``Completion.events``); a route that answers with one JSON
object gets the answers only (``Completion.answers``). Both read the engine through one loop
(``Completion._sample``: admission, the engine's contract, its errors) and record the same way. The
records are written, token-exact, before the last event goes out. A completion stopped early (the client
went away, the task was cancelled) is recorded with the tokens sampled so far and
``finish_reason="cancelled"``, and its engine rows stop at the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ..engines.base import SamplingParams, TokenDelta, stream_tokens
from ..errors import ConstraintError, LifecycleError
from .errors import APIError
from .records import ExchangeRecord
from .schemas import FunctionCallOut, TokenLogprob, ToolCallOut, TopLogprob
from .state import GatewayState
from .tokens import Detokenizer, TextStream, completion_room, render_prompt
from .tool_calls import ContentDelta, ToolCallStream, ToolCallStyle, format_tool_call_id, parse_tool_calls

__all__ = ["Answer", "Completion", "CompletionInput", "Done", "Endpoint", "Event", "TextDelta", "ToolCallDelta",
           "logprob_entries"]

logger = logging.getLogger(__name__)

Endpoint = Literal["chat.completions", "responses"]


def _tool_call_style(call: CompletionInput) -> ToolCallStyle:
    """``"hermes"`` when a grammar holds the reply to Hermes blocks (or the JSON answer of a ``response_format``):
    a reply opening with ``{`` is then that answer and streams live. Else ``"auto"``: such a reply may be a
    llama3 call, known only at its end."""
    return "hermes" if call.params.grammar is not None else "auto"


# --- what the pipeline takes --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CompletionInput:
    """One call, ready to run: validated, its model name and token limit checked (``parsing.completion_input``).

    The Responses route translates its request into the chat request that means the same before building
    this, so everything here is in chat completions' terms.
    """

    endpoint: Endpoint
    """The API the request came through (kept in the record)."""
    request_id: str
    """The response's id (``chatcmpl-...``, ``resp_...``)."""
    model: str
    """The model name as requested (echoed back and recorded)."""
    messages: list[dict[str, Any]]
    """The conversation as chat messages: what the chat template renders and the record keeps."""
    tools: list[dict[str, Any]] | None
    """The chat-format tool schemas the template shows the model; None: none (none sent, or tool_choice "none")."""
    tool_names: list[str] | None
    """The functions whose calls are parsed out of the text; None: no parsing (exactly when ``tools`` is None)."""
    params: SamplingParams
    """What the engine samples with (``n`` choices, stop strings, constraints...)."""
    top_logprobs: int
    """Alternatives per token for the client; -1: the client asked for no logprobs at all."""
    raw: dict[str, Any]
    """The body as received (kept in the record)."""
    rollout_id: str | None
    """The rollout the call belongs to, if any."""
    caller: str | None
    """The ``X-Art-Caller`` label, if any."""
    max_tokens_param: str | None = None
    """The request field that set ``params.max_tokens``; None: the gateway's default (shortened to what is left
    of the context when the prompt is long, where a length the request set is refused)."""


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
    recorded: bool = False
    """Its record is written (a cut call records only the choices that are not)."""


OnToken = Callable[[_Choice, TokenDelta], None]
"""Called with each delta once its choice has taken it (``events`` hands them to the request's task)."""


class Completion:
    """One call's completion: rendered at construction, sampled and recorded by ``events()``/``answers()``.

    Args:
        state: the app's state.
        call: the call, validated and checked (``parsing.completion_input`` builds it from a request).

    Raises:
        APIError: the chat template cannot render the conversation (4xx).
    """

    def __init__(self, state: GatewayState, call: CompletionInput) -> None:
        self.started = time.perf_counter()
        self.created = time.time()
        self.state, self.input = state, call
        self.prompt_ids = render_prompt(state.engine.tokenizer, call.messages, call.tools,
                                        encoder=state.prompt_encoder, template=state.chat_template)
        room = completion_room(state.engine.tokenizer, len(self.prompt_ids), call.params.max_tokens,
                               call.max_tokens_param)
        if room != call.params.max_tokens:
            self.input = call = dataclasses.replace(call, params=dataclasses.replace(call.params, max_tokens=room))
        self._waited = 0.0
        """Seconds the call was held by a training pause."""
        self._engine_called = 0.0

    async def answers(self) -> list[Answer]:
        """Sample every choice to its end and return the answers (records written), in choice order.

        ``events`` without the streamed text and tool calls: the engine is read in the request's own task,
        as the pump's task and queue and the generator layers every token passes through there (about a
        quarter of the gateway's own time per call, benchmark part (c)) would add nothing. Records, errors
        and cancellation are the same.

        Raises:
            APIError: the gateway closed (503); the engine refused the request (400), is unavailable (503),
                failed or broke its contract (500).
        """
        with self.state.control.answering(self.input.rollout_id):  # counted until answered (GET .../status)
            choices = [_Choice(i, None, None) for i in range(self.input.params.n)]
            try:
                await self._sample(choices, None)
            except asyncio.CancelledError:  # the client went away, or the task was cancelled
                self._record_cut(choices)
                raise
            return [self._record(c) for c in choices]

    async def events(self) -> AsyncIterator[Event]:
        """Sample, yielding each choice's text and tool calls as they come, then a ``Done`` per choice.

        The ``Done`` events come after every choice has ended and every record has been written. If the
        iteration stops early (the reader closed it, or its task was cancelled), each choice not recorded
        yet is recorded with the tokens sampled so far (``finish_reason="cancelled"`` if it had not ended).

        Raises:
            APIError: the gateway closed (503); the engine refused the request (400), is unavailable (503),
                failed or broke its contract (500).
        """
        with self.state.control.answering(self.input.rollout_id):  # counted until answered (GET .../status)
            state, call = self.state, self.input
            choices = [_Choice(i, TextStream(state.detokenizer, call.params.stop),
                               ToolCallStream(tool_names=call.tool_names, style=_tool_call_style(call))
                               if call.tool_names is not None else None)
                       for i in range(call.params.n)]
            pump = _EnginePump(lambda on_token: self._sample(choices, on_token))
            cut = False
            try:
                async for choice, delta in pump:
                    for event in self._live_events(choice, delta):
                        yield event
                # The held-back text and calls first (a call's id is given when it is streamed), then the records.
                tails = [self._tail(c) for c in choices]
                answers = [self._record(c) for c in choices]
                for choice, answer, tail in zip(choices, answers, tails, strict=True):
                    for event in tail:
                        yield event
                    yield Done(answer, self._flush(choice) if call.top_logprobs >= 0 else None)
            except (GeneratorExit, asyncio.CancelledError):  # the client went away, or the task was cancelled
                cut = True
                raise
            finally:
                await pump.stop()  # stops the engine's rows when the iteration ended early
                if cut:
                    self._record_cut(choices)

    # --- the engine ---

    async def _sample(self, choices: list[_Choice], on_token: OnToken | None) -> None:
        """Admission, then the engine's tokens into ``choices`` until every choice has ended.

        The one loop both ways of answering run: ``answers`` in the request's task, ``events`` in its
        pump's task. Every delta must keep the engine's contract (``_take``); the engine's failures become
        the API's errors; on any early end the engine's stream is closed, which stops its rows.

        Raises:
            APIError: see ``events``.
        """
        state, params = self.state, self.input.params
        tokens = stream_tokens(state.engine, self.prompt_ids, params)
        try:
            async with state.control.admitted() as waited:
                self._waited, self._engine_called = waited, time.perf_counter()
                try:
                    async for delta in tokens:
                        choice = _take(choices, delta, params.n, time.perf_counter())
                        if on_token is not None:
                            on_token(choice, delta)
                except (APIError, asyncio.CancelledError):
                    raise
                except Exception as exc:
                    raise _engine_failure(exc, params) from exc
        finally:
            await tokens.aclose()  # type: ignore[attr-defined]  # stops the engine's rows on an early end
        unfinished = [c.index for c in choices if c.finish is None]
        if unfinished:
            raise _contract_broken(f"ended without finishing completion(s) {unfinished}")

    # --- per token ---

    def _live_events(self, choice: _Choice, delta: TokenDelta) -> list[Event]:
        assert choice.text is not None
        if self.input.top_logprobs >= 0:
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
        if self.input.top_logprobs < 0:
            return None
        entries, choice.pending = choice.pending, []
        return entries

    # --- at the end ---

    def _final_text(self, choice: _Choice) -> str:
        text = self.state.detokenizer.decode(choice.token_ids)
        cuts = [text.find(s) for s in self.input.params.stop if s in text]
        return text[: min(cuts)] if cuts else text

    def _answer(self, choice: _Choice) -> tuple[Answer, int]:
        """The choice's answer, parsed from its whole text; and how many tool-call blocks failed to parse."""
        call, detokenizer = self.input, self.state.detokenizer
        text = self._final_text(choice)
        finish = choice.finish or "cancelled"
        # The engine should stop on stop strings itself; cutting keeps OpenAI's contract if it did not.
        if finish != "cancelled" and any(s in detokenizer.decode(choice.token_ids) for s in call.params.stop):
            finish = "stop"
        content: str | None = text
        calls: list[ToolCallOut] = []
        errors = 0
        if call.tool_names is not None:
            parsed = parse_tool_calls(text, tool_names=call.tool_names, style=_tool_call_style(call))
            content, errors = parsed.content, parsed.parse_errors
            ids = choice.call_ids + [format_tool_call_id() for _ in parsed.tool_calls[len(choice.call_ids):]]
            calls = [ToolCallOut(id=call_id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                     for call_id, c in zip(ids, parsed.tool_calls, strict=False)]
            if calls and finish == "stop":  # a cut-off completion still says "length"
                finish = "tool_calls"
        logprobs = (self._entries(choice.token_ids, choice.logprobs, choice.top or None)
                    if call.top_logprobs >= 0 else None)
        return Answer(choice.index, content, calls, finish, logprobs, len(choice.token_ids), choice.adapter_step), errors

    def _record(self, choice: _Choice) -> Answer:
        """Write the choice's record (flushed to disk) and count it; returns its answer."""
        answer, errors = self._answer(choice)
        reply: dict[str, Any] = {"role": "assistant", "content": answer.content}
        if answer.tool_calls:
            reply["tool_calls"] = [c.model_dump() for c in answer.tool_calls]
        state, call = self.state, self.input
        # Constructed without validating again: every value was made and typed by the pipeline (validation
        # would also deep-copy the request and messages, per call).
        state.records.add(ExchangeRecord.model_construct(
            request_id=call.request_id, choice_index=choice.index, rollout_id=call.rollout_id, created=self.created,
            endpoint=call.endpoint, model=call.model, adapter_step=choice.adapter_step, request=call.raw,
            prompt_token_ids=self.prompt_ids, completion_token_ids=list(choice.token_ids),
            logprobs=list(choice.logprobs), finish_reason=answer.finish_reason, timings=self._timings(choice),
            messages=call.messages, tools=call.tools or [], reply={k: v for k, v in reply.items() if v is not None},
            caller=call.caller,
        ))
        choice.recorded = True
        metrics = state.metrics
        metrics.records_written += 1
        metrics.completion_tokens += len(choice.token_ids)
        metrics.tool_call_parse_errors += errors
        metrics.tool_calls += len(answer.tool_calls)
        if choice.index == 0:
            metrics.completions += 1
            metrics.prompt_tokens += len(self.prompt_ids)
        return answer

    def _timings(self, choice: _Choice) -> dict[str, float]:
        now = time.perf_counter()
        first = choice.first_token_at or now
        return {"wait": self._waited, "queue": max(first - (self._engine_called or first), 0.0),
                "generate": (choice.last_token_at or first) - first, "total": now - self.started}

    def _record_cut(self, choices: list[_Choice]) -> None:
        """The call stopped early: every choice not recorded yet is, as it stands (never dropped silently)."""
        left = [c for c in choices if not c.recorded]
        if any(c.finish is None for c in left):
            self.state.metrics.completions_cancelled += 1
            logger.info("request %s (rollout %s) stopped early; recorded with the tokens sampled so far (%s)",
                        self.input.request_id, self.input.rollout_id, [len(c.token_ids) for c in choices])
        for choice in left:
            choice.finish = choice.finish or "cancelled"
            try:
                self._record(choice)
            except Exception:  # the record is the point: say loudly that it could not be written
                logger.exception("could not record cancelled choice %d of %s", choice.index, self.input.request_id)

    def _entries(self, token_ids: list[int], logprobs: list[float],
                 top: list[dict[int, float]] | None) -> list[TokenLogprob]:
        return logprob_entries(token_ids, logprobs, top, self.state.detokenizer, max(self.input.top_logprobs, 0))


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
    """Runs ``Completion._sample`` for ``events`` in a task of its own, so the request leaves the engine (and
    stops counting in flight) when generation ends, not when a slow client has read the last chunk: a slow
    reader cannot hold a training pause. Iterate it for each ``(choice, delta)`` as its choice takes it; the
    sampling's errors are raised there.
    """

    _END = object()

    def __init__(self, sample: Callable[[OnToken], Awaitable[None]]) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._task = asyncio.create_task(self._run(sample))

    async def _run(self, sample: Callable[[OnToken], Awaitable[None]]) -> None:
        try:
            await sample(lambda choice, delta: self._queue.put_nowait((choice, delta)))
            self._queue.put_nowait(self._END)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the reader, which raises it in the request's task
            self._queue.put_nowait(exc)

    def __aiter__(self) -> _EnginePump:
        return self

    async def __anext__(self) -> tuple[_Choice, TokenDelta]:
        item = await self._queue.get()
        if item is self._END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        taken: tuple[_Choice, TokenDelta] = item
        return taken

    async def stop(self) -> None:
        """Cancel the engine's side if it is still running, and wait until its rows are released."""
        if not self._task.done():
            self._task.cancel()
            await asyncio.wait([self._task])


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
