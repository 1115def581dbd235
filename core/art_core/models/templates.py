"""Chat templates installed into the base models that ``models/`` prepares.

SmolLM2's own template (kept next to the converted model as ``original_chat_template.jinja``) is
plain ChatML and ignores ``tools``. ``CHATML_TOOLS_TEMPLATE`` keeps exactly that rendering for
conversations without tools and adds tool calling in the Hermes / Qwen2.5 convention:

    <|im_start|>system
    {system prompt}

    # Tools
    ...one JSON schema per line inside <tools></tools>, then how to call one...<|im_end|>
    <|im_start|>user
    What is the weather in Paris?<|im_end|>
    <|im_start|>assistant
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    18 C, cloudy
    </tool_response><|im_end|>
    <|im_start|>assistant

Consecutive ``tool`` messages share one ``user`` turn, as in Qwen2.5, so the conventions are the same
and there is one template, not two.

The trainer merges the calls of a multi-turn rollout by token prefix, so the template keeps one
property for every conversation: rendering ``messages[:k]`` with ``add_generation_prompt=True`` gives a
prefix of rendering ``messages[:k + 1]`` when message ``k`` is the assistant's, and every assistant turn
ends with ``<|im_end|>`` (the eos token) followed by a single ``"\\n"``. Nothing in a turn depends on the
messages after it, except whether a run of tool responses is closed, and a following assistant message
closes it exactly as the end of the conversation does.

Tool-call arguments may be a dict (rendered as a JSON object) or a string (rendered verbatim, since
OpenAI clients send arguments as the JSON text the model produced).
"""

from __future__ import annotations

__all__ = [
    "CHATML_TOOLS_TEMPLATE",
    "ORIGINAL_CHAT_TEMPLATE_FILE",
    "SMOLLM2_DEFAULT_SYSTEM_PROMPT",
]

#: The system prompt SmolLM2's own template inserts when a conversation does not start with one.
SMOLLM2_DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

#: File name, inside a converted model folder, of the chat template the model shipped with.
ORIGINAL_CHAT_TEMPLATE_FILE = "original_chat_template.jinja"

# Every tag strips the whitespace around it ("{%-", "-%}"), so all output comes from the quoted strings
# and the layout below is free. Jinja string literals turn "\n" into a newline.
CHATML_TOOLS_TEMPLATE = (
    r"""
{#- ChatML with Hermes/Qwen2.5-style tool calls; see art_core/models/templates.py. -#}
{%- macro render_content(content) -%}
    {#- A string, None, or OpenAI content parts ([{"type": "text", "text": ...}]). -#}
    {%- if content is none -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part.type == 'text' -%}
                {{- part.text -}}
            {%- else -%}
                {{- raise_exception('this model reads text only; got a content part of type ' ~ part.type) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}

{#- The system turn: the conversation's own system message, or SmolLM2's default one. -#}
{%- if messages and messages[0].role == 'system' -%}
    {%- set system_text = render_content(messages[0].content) -%}
    {%- set first_index = 1 -%}
{%- else -%}
    {%- set system_text = '"""
    + SMOLLM2_DEFAULT_SYSTEM_PROMPT
    + r"""' -%}
    {%- set first_index = 0 -%}
{%- endif -%}
{%- if tools or messages -%}
    {{- '<|im_start|>system\n' + system_text -}}
    {%- if tools -%}
        {{- '\n\n# Tools\n\nYou may call one or more of the functions below. '
            + 'Their JSON schemas are listed inside <tools></tools> XML tags:\n<tools>' -}}
        {%- for tool in tools -%}
            {{- '\n' + tool | tojson -}}
        {%- endfor -%}
        {{- '\n</tools>\n\nTo call a function, answer with a JSON object holding its name and arguments '
            + 'inside <tool_call></tool_call> XML tags, one block per call:\n'
            + '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>' -}}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- endif -%}

{%- for message in messages -%}
    {%- if loop.index0 < first_index -%}
        {#- The leading system message is already in the system turn. -#}
    {%- elif message.role == 'assistant' -%}
        {%- set text = render_content(message.content) -%}
        {{- '<|im_start|>assistant\n' + text -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if text or not loop.first -%}
                {{- '\n' -}}
            {%- endif -%}
            {{- '<tool_call>\n{"name": ' + fn.name | tojson + ', "arguments": ' -}}
            {%- if fn.arguments is string -%}
                {{- fn.arguments -}}
            {%- elif fn.arguments is mapping -%}
                {{- fn.arguments | tojson -}}
            {%- else -%}
                {{- '{}' -}}
            {%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {#- A run of tool responses shares one user turn. -#}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + render_content(message.content) + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""
).strip()
"""ChatML with tool calling for SmolLM2 (Hermes / Qwen2.5 conventions); see the module docstring."""
