"""The chat completions API's request and response bodies, as typed models.

Requests accept unknown fields (clients send many: ``user``, ``metadata``, ``store``...); ``parsing.py``
logs their names at debug level and otherwise ignores them. Known fields are checked strictly, and a
failed check names the field (``messages[2].role``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "ChatCompletion",
    "ChatCompletionRequest",
    "ChatMessage",
    "Choice",
    "ChoiceLogprobs",
    "ResponseMessage",
    "TokenLogprob",
    "ToolDefinition",
    "Usage",
    "check_json_schema",
]


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


# --- request --------------------------------------------------------------------------------------


class FunctionCallIn(_Loose):
    name: str
    arguments: str | dict[str, Any] = "{}"
    """JSON text, as OpenAI clients send it (a dict is accepted too)."""


class ToolCallIn(_Loose):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ContentPart(_Loose):
    type: str
    """``text`` for text; other types (``image_url``...) reach the chat template, which may refuse them (422)."""
    text: str | None = None


class ChatMessage(_Loose):
    """One message of the conversation, in OpenAI's chat format."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    """Text, or a list of content parts; None for an assistant turn that only calls tools."""
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    """Calls an assistant turn made; their ``arguments`` are JSON text."""
    tool_call_id: str | None = None
    """For ``role="tool"``: the call this message answers."""


class FunctionDefinition(_Loose):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """Letters, digits, ``_``, ``.`` and ``-``, at most 64 (OpenAI's rule)."""
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON Schema of type ``object``; omitted or ``{}``: the function takes no arguments."""
    strict: bool | None = None
    """Accepted; not enforced (see ``tool_choice``)."""

    @field_validator("parameters")
    @classmethod
    def _valid_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:  # None and {} both mean "no parameters"
            if value.get("type") != "object":
                raise ValueError(
                    f"a function's parameters must be a JSON Schema with \"type\": \"object\" (got type "
                    f"{value.get('type')!r}); omit parameters for a function without arguments"
                )
            check_json_schema(value)
        return value


class ToolDefinition(_Loose):
    type: Literal["function"]
    """Only function tools: the model can call nothing else."""
    function: FunctionDefinition


class NamedFunction(_Loose):
    name: str


class NamedToolChoice(_Loose):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Loose):
    include_usage: bool | None = None
    """Send a last chunk with token counts (its ``choices`` is empty)."""


class JsonSchemaFormat(_Loose):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            check_json_schema(value)
        return value


class ResponseFormat(_Loose):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError('type "json_schema" needs json_schema.schema: the JSON Schema the answer must follow')
        return self


class ChatCompletionRequest(_Loose):
    """``POST /v1/chat/completions``. Field meanings follow OpenAI's API reference."""

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """``none`` leaves the tools out of the prompt and parses no calls. ``auto`` (default with tools) lets
    the model answer in text or call tools. ``required`` (one or more calls) and a named function (exactly
    that call, which must be one of ``tools``) are enforced by constrained decoding where the engine
    supports it (``SamplingParams.grammar``): the completion is Hermes ``<tool_call>`` blocks whose
    arguments follow the tool's ``parameters`` schema."""
    parallel_tool_calls: bool | None = None
    """False: one call at most where the reply is constrained (``tool_choice`` "required" or a named function, or
    tools beside a ``response_format``); with plain "auto" the model may still write several."""
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    """Default 1; 0 is greedy."""
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    """Preferred over ``max_tokens`` when both are given (OpenAI deprecated the old name)."""
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(None, ge=1, le=64)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # Sampling options that change the distribution sampled from. The trainer learns the model's own
    # distribution and weighs each token by the sampler's recorded log-prob: a penalised or biased sampler would
    # make those log-probs another policy's. Neutral values are accepted (clients send them), others refused.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    functions: list[Any] | None = None
    function_call: Any = None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value:
            raise ValueError(f"{value} is not supported by the training gateway: penalties would sample from a "
                             "distribution other than the model being trained (the recorded log-probs would not "
                             "be the policy's); leave it out or set 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value and any(value.values()):
            raise ValueError("is not supported by the training gateway: a bias would sample from a distribution "
                             "other than the model being trained (the recorded log-probs would not be the "
                             "policy's); leave it out")
        return value

    @field_validator("functions", "function_call")
    @classmethod
    def _no_legacy_functions(cls, value: Any) -> Any:
        if value:
            raise ValueError("the legacy functions API is not supported: pass tools=[{\"type\": \"function\", "
                             "\"function\": {...}}] and tool_choice instead")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("stop takes up to 16 non-empty strings")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: function names must be unique, got {names}")
        if self.tool_choice == "required" and not names:
            raise ValueError('tool_choice "required" needs at least one tool in tools')
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(
                f"tool_choice names function {self.tool_choice.function.name!r}, which is not in tools {names}")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


def check_json_schema(schema: dict[str, Any]) -> None:
    """Check ``schema`` is a valid JSON Schema (with ``jsonschema``, against the draft it declares).

    Raises:
        ValueError: it is not, with jsonschema's reason and where in the schema.
    """
    from jsonschema import exceptions, validators  # imported here: only requests with schemas need it

    cls = validators.validator_for(schema, default=validators.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except exceptions.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise ValueError(f"not a valid JSON Schema: {exc.message} at {where}") from None


# --- response -------------------------------------------------------------------------------------


class FunctionCallOut(BaseModel):
    name: str
    arguments: str
    """JSON text of the arguments object."""


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    """The answer's text; None when the model only called tools."""
    tool_calls: list[ToolCallOut] | None = None
    refusal: None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    """The token's UTF-8 bytes (a token may hold part of a character)."""


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]
    """The ``top_logprobs`` most likely tokens at this position, most likely first."""


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


class Choice(BaseModel):
    index: int
    message: ResponseMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    """Over all ``n`` choices."""
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    """The model name as requested."""
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None
    """``adapter-<step>``: which checkpoint answered."""
