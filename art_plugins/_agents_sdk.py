"""The Agents SDK side of ``art_plugins.openai_agents``: the model provider that points the trainable model's names
at the rollout's gateway, the call labels, and how the SDK's errors map to a trajectory's stop reason.

Apart from ``openai_agents.py`` so that the user-facing module reads as the runner and the capture; nothing here
is public (import from ``art_plugins.openai_agents``).
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextvars import ContextVar
from typing import Any, Literal, cast

import httpx2
import openai
from agents import (
    Agent,
    InputGuardrailTripwireTriggered,
    MaxTurnsExceeded,
    Model,
    ModelBehaviorError,
    ModelProvider,
    ModelRefusalError,
    OpenAIProvider,
    OutputGuardrailTripwireTriggered,
    RunConfig,
    StreamEvent,
    ToolErrorFormatterArgs,
    ToolInputGuardrailTripwireTriggered,
    ToolOutputGuardrailTripwireTriggered,
)
from agents.models import get_default_model
from agents.run_config import CallModelData, ModelInputData
from pydantic import BaseModel

from art_core import TrainableModel
from art_core._warnings import warn_at_caller
from art_core.errors import ConfigError

from ._routing import CountingTransport, Route

Api = Literal["responses", "chat_completions"]

# The SDK's errors that end a run over something the model did: the run is kept as a trajectory, marked
# with the reason, because it is exactly what training should see (and usually penalise).
_STOP_REASONS: tuple[tuple[type[BaseException], str], ...] = (
    (MaxTurnsExceeded, "max_turns"),
    (ModelBehaviorError, "model_behavior_error"),
    (ModelRefusalError, "model_refusal"),
    (OutputGuardrailTripwireTriggered, "output_guardrail"),
    (ToolInputGuardrailTripwireTriggered, "tool_input_guardrail"),
    (ToolOutputGuardrailTripwireTriggered, "tool_output_guardrail"),
    (InputGuardrailTripwireTriggered, "input_guardrail"),
)
_KEPT_ERRORS = tuple(error for error, _ in _STOP_REASONS)
# ``error_handlers`` kinds, and the stop reason a handled one leaves on the trajectory.
_HANDLED_STOP_REASONS = {"max_turns": "max_turns", "model_refusal": "model_refusal",
                         "invalid_final_output": "model_behavior_error"}

_calling_agent: ContextVar[str | None] = ContextVar("art_plugins_calling_agent", default=None)
"""Name of the agent whose model call the current task is making (set just before each call)."""


class _GatewayProvider(ModelProvider):
    """Builds the trainable model's names against the rollout's gateway URL; hands other names to ``fallback``.

    Args:
        model: the trainable model.
        rollout_id: the run's rollout id (its calls go to ``model.rollout_base_url(rollout_id)``).
        names: the model names that mean the trainable model.
        api: which OpenAI API to speak to the gateway (None: the SDK's default).
        fallback: the provider for every other name (the run's own ``RunConfig.model_provider``).
        owns_fallback: close ``fallback`` with this provider (the SDK would have owned it).
        route: the rollout's route, where the calls to the gateway are counted.
    """

    def __init__(self, model: TrainableModel, *, rollout_id: str, names: frozenset[str], api: Api | None,
                 fallback: ModelProvider, owns_fallback: bool, route: Route) -> None:
        self._model = model
        self._rollout_id = rollout_id
        self._names = names
        self._use_responses = None if api is None else api == "responses"
        self._fallback = fallback
        self._owns_fallback = owns_fallback
        self._route = route
        self._client: openai.AsyncOpenAI | None = None
        self._trainable: Model | None = None

    def get_model(self, model_name: str | None) -> Model:
        name = model_name or get_default_model()
        # "openai/gpt-4.1" is the SDK's (MultiProvider's) spelling of OpenAI's "gpt-4.1": either names it
        if name in self._names or name.removeprefix("openai/") in self._names:
            return self._trainable_model()
        try:
            return self._fallback.get_model(model_name)
        except openai.OpenAIError as exc:  # typically: no OPENAI_API_KEY for a model that is not ours
            raise ConfigError(
                f"an agent runs on model {model_name or get_default_model()!r}, which is not the trainable model "
                f"(its names: {sorted(self._names)}), and the SDK could not set that model up: {str(exc).rstrip('.')}. Name the "
                f"trainable model in the agent, or pass model_names=[{model_name or get_default_model()!r}] to "
                "train it in that model's place") from exc

    def _trainable_model(self) -> Model:
        if self._trainable is None:
            # The gateway on loopback takes any key; the model name sent is the one the gateway serves.
            # Its calls are counted on the rollout's route, so a run cut short can wait for their records.
            http = openai.DefaultAsyncHttpxClient(transport=CountingTransport(httpx2.AsyncHTTPTransport(), self._route))
            # The route's URL: the rollout's gateway, or in demonstration mode the teacher proxy.
            self._client = openai.AsyncOpenAI(base_url=self._route.base_url, api_key=self._route.api_key or "local",
                                              http_client=http)
            provider = OpenAIProvider(openai_client=self._client, use_responses=self._use_responses,
                                      use_responses_websocket=False)  # the gateway speaks HTTP only
            self._trainable = provider.get_model(self._model.name)
        return self._trainable

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()
        if self._owns_fallback:
            await self._fallback.aclose()


def _labelling(user_filter: Callable[[CallModelData[Any]], Any] | None
               ) -> Callable[[CallModelData[Any]], Awaitable[ModelInputData]]:
    """A ``call_model_input_filter`` that labels the coming call with its agent, then runs the run's own filter."""
    async def label(data: CallModelData[Any]) -> ModelInputData:
        # The SDK awaits this in the task that then makes the call: the route reads the label there.
        _calling_agent.set(data.agent.name)
        if user_filter is None:
            return data.model_data
        updated = user_filter(data)
        return cast(ModelInputData, await updated if inspect.isawaitable(updated) else updated)
    return label


async def _drain(events: AsyncIterator[StreamEvent]) -> BaseException | None:
    """Read ``events`` to their end; the SDK error that ended the run over the model's behaviour, if any."""
    try:
        async for _ in events:
            pass
    except _KEPT_ERRORS as exc:
        return exc
    return None


@contextlib.contextmanager
def _no_label() -> Iterator[None]:
    """No call label in the code inside (a task started there copies it); the caller's is restored after."""
    token = _calling_agent.set(None)
    try:
        yield
    finally:
        _calling_agent.reset(token)


def _builds_own_model(agent: Agent[Any], run_config: RunConfig | dict[str, Any] | None) -> bool:
    """Whether the run may call a ``Model`` object built outside our provider (so only the redirect can route it).

    Walks the agents the run can reach: handoffs and agents used as tools. A handoff whose target cannot be
    seen (a hand-made ``Handoff``) counts as "may": better an idle redirect than a call that escapes.
    """
    config_model = run_config.get("model") if isinstance(run_config, dict) else getattr(run_config, "model", None)
    if isinstance(config_model, Model):
        return True
    seen: set[int] = set()
    stack: list[Any] = [agent]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(getattr(current, "model", None), Model):
            return True
        for target in getattr(current, "handoffs", None) or ():
            if isinstance(target, Agent):
                stack.append(target)
                continue
            ref = getattr(target, "_agent_ref", None)  # set by handoff(agent); a weak reference
            reached = ref() if callable(ref) else None
            if reached is None:
                return True
            stack.append(reached)
        for tool in getattr(current, "tools", None) or ():
            inner = getattr(tool, "_agent_instance", None)  # Agent.as_tool() keeps its agent here
            if inner is not None:
                if _tool_run_config(tool) is not None:
                    _warn_own_run_config(tool, inner)
                stack.append(inner)
    return False


def _tool_run_config(tool: Any) -> RunConfig | None:
    """The ``RunConfig`` an ``Agent.as_tool(..., run_config=...)`` tool was given, if any.

    The SDK keeps it only in the closure of the tool's invoker (0.24: ``on_invoke_tool._invoke_tool_impl``), so it is
    looked for there; where the SDK keeps it elsewhere this finds nothing, and the run goes on as before.
    """
    invoker = getattr(tool, "on_invoke_tool", None)
    for function in (getattr(invoker, "_invoke_tool_impl", None), invoker):
        for cell in getattr(function, "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # an empty cell
                if isinstance(cell.cell_contents, RunConfig):
                    return cell.cell_contents
    return None


def _warn_own_run_config(tool: Any, agent: Agent[Any]) -> None:
    warn_at_caller(UserWarning(
        f"the agent {agent.name!r} is used as a tool ({getattr(tool, 'name', '?')!r}) with a run_config of its own: the "
        "SDK runs it with that RunConfig instead of the run's, so its calls do not reach the trainable model (they go "
        "to that RunConfig's provider, by default the SDK's OpenAI client) and are not in the trajectory; when they "
        "fail, as_tool's failure handler only tells the model that the tool failed. Leave run_config out of "
        "as_tool() to have the agent run on the run's configuration."))


def _check_agent(agent: Any) -> None:
    if not isinstance(agent, Agent):
        raise ConfigError(f"starting_agent must be an agents.Agent, got {type(agent).__name__}")


def _stop_reason(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "timeout"
    return next(reason for kind, reason in _STOP_REASONS if isinstance(error, kind))


def _describe(error: BaseException, timeout: float | None) -> str:
    if isinstance(error, TimeoutError):
        return f"TimeoutError: the run took longer than timeout={timeout} s and was cancelled"
    return f"{type(error).__name__}: {error}"


def _note_outside_call(error: BaseException, model: TrainableModel, *, nested_config_taken: bool = False) -> None:
    """Note on an OpenAI error that did not come from the trainable model's gateway where such calls usually come
    from: an agent a guardrail or tool ran itself (``Runner.run(checker, ...)``), which the SDK gives none of the
    run's configuration, so it went to the SDK's default client (no key there, or a model name only we serve)."""
    if not isinstance(error, openai.OpenAIError):
        return
    request = getattr(error, "request", None)  # APIConnectionError and APIStatusError carry theirs
    try:
        gateway = httpx2.URL(model.base_url).netloc
    except Exception:  # no gateway to compare with (not registered): say nothing rather than guess
        return
    if request is not None and httpx2.URL(str(request.url)).netloc == gateway:
        return
    if nested_config_taken:  # a run the agent's own code started did take current_run_config()
        error.add_note("art-plugins: this call did not go to the trainable model's gateway. A run started inside this "
                       "one took run_config=current_run_config(), so its agent most likely builds its own Model "
                       "object (OpenAIChatCompletionsModel(...), OpenAIResponsesModel(...)), which no RunConfig "
                       "provider reaches: give that agent the model's name (model=\"...\") instead. An agent on "
                       "another model needs that model's own credentials.")
        return
    error.add_note("art-plugins: this call did not go to the trainable model's gateway. If it came from an agent that "
                   "a guardrail or tool of the run starts itself (await Runner.run(checker, ...)), pass "
                   "run_config=current_run_config() (from art_plugins.openai_agents) to that Runner.run: its calls "
                   "then reach the rollout's gateway. An agent on another model needs that model's own credentials.")


def _last_agent(error: BaseException | None) -> Agent[Any] | None:
    run_data = getattr(error, "run_data", None)  # the SDK attaches what the run had to its errors
    return getattr(run_data, "last_agent", None)


def _as_text(output: Any) -> str | None:
    """A final output as text for ``metadata``: strings as they are, models and other values as JSON."""
    if output is None or isinstance(output, str):
        return output
    if isinstance(output, BaseModel):
        return output.model_dump_json()
    try:
        return json.dumps(output, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(output)


def _reporting(user_formatter: Callable[[ToolErrorFormatterArgs[Any]], Any] | None,
               errors: list[str]) -> Callable[[ToolErrorFormatterArgs[Any]], Awaitable[str | None]]:
    """A ``tool_error_formatter`` that appends each tool error to ``errors``, then runs the run's own formatter."""
    async def report(args: ToolErrorFormatterArgs[Any]) -> str | None:
        # The SDK shows the model only a generic message; the exception itself is what a person reading
        # the trajectory needs. (It may hold sensitive data: it is stored with the trajectory.)
        cause = f"{type(args.error).__name__}: {args.error}" if args.error is not None else args.default_message
        agent = _calling_agent.get()
        errors.append(f"tool {args.tool_name!r} ({args.kind}, call {args.call_id}"
                      f"{f', agent {agent!r}' if agent else ''}): {cause}")
        if user_formatter is None:
            return None  # the SDK's default message
        message = user_formatter(args)
        return cast(str | None, await message if inspect.isawaitable(message) else message)
    return report


def _noting(kind: str, handler: Callable[[Any], Any], note: Callable[[str], None]) -> Callable[[Any], Awaitable[Any]]:
    """An ``error_handlers`` entry that calls ``note(kind)`` when ``handler`` turned the error into a final output."""
    async def handle(data: Any) -> Any:
        outcome = handler(data)
        if inspect.isawaitable(outcome):
            outcome = await outcome
        if outcome is not None:  # handled: the run ends with this output, but it did stop early
            note(kind)
        return outcome
    return handle
