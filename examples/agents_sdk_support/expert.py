"""The support desk's scripted expert: the teacher of ``--demos`` (see ``examples._expert``).

It stands in for a strong hosted model (a scripted expert), answering every agent of the desk; which agent asks is
plain from the tools its request offers, as it would be to a hosted model:

- ``Triage`` (the handoff tools ``transfer_to_billing`` and ``transfer_to_technical``): hands an invoice question
  ("How much do I owe on invoice INV-1042?") to Billing and a service question ("Is login working right now?") to
  Technical;
- ``Billing`` (``invoice_total``) or ``Technical`` (``service_status``): looks the invoice or the service up, and
  once the tool's result is in, answers with the structured output (``SupportAnswer`` as JSON: its department, and
  a reply quoting the result).

It reads the customer's question and the tools' results from the conversation and knows nothing else.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from .._expert import ScriptedExpert, ToolCall, message_text
from .agent import SupportAnswer

__all__ = ["EXPERT_NAME", "support_expert", "support_policy"]

EXPERT_NAME = "support-expert"

_INVOICE = re.compile(r"\bINV-\d+\b", re.IGNORECASE)
_SERVICE = re.compile(r"\bIs (.+?) working\b", re.IGNORECASE)
# Each desk's lookup tool and how the expert words the reply around its result.
_LOOKUPS = {"billing": ("invoice_total", "invoice_id", "Invoice {0} totals {1}."),
            "technical": ("service_status", "service", "{0} is {1} right now.")}


def _question(messages: list[dict[str, Any]]) -> tuple[Literal["billing", "technical"], str]:
    """The customer's question as ``(department, what to look up)``: ``("billing", "INV-1042")`` or
    ``("technical", "login")``."""
    asked = [m for m in messages if m.get("role") == "user"]
    if not asked:
        raise ValueError("the conversation has no user message")
    text = message_text(asked[0])  # the customer's message opens the run; a handoff keeps it in the history
    if invoice := _INVOICE.search(text):
        return "billing", invoice[0].upper()
    if service := _SERVICE.search(text):
        return "technical", service[1]
    raise ValueError(f"neither an invoice number (INV-1234) nor 'Is <service> working' in {text[:80]!r}")


def _result_of(messages: list[dict[str, Any]], tool: str) -> str | None:
    """The result of the conversation's last call to ``tool``, or None when it was not called."""
    called = {call.get("id") for m in messages if m.get("role") == "assistant" for call in m.get("tool_calls") or []
              if call.get("function", {}).get("name") == tool}
    results = [message_text(m) for m in messages if m.get("role") == "tool" and m.get("tool_call_id") in called]
    return results[-1] if results else None


def support_policy(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> ToolCall | str:
    """The next turn of whichever desk agent asks: a handoff, a lookup, or the ``SupportAnswer`` JSON.

    Raises:
        ValueError: the customer's message is neither an invoice nor a service question, or the request offers
            neither a handoff to the right desk nor that desk's lookup tool.
    """
    department, subject = _question(messages)
    offered = {str(t.get("function", {}).get("name")) for t in tools}
    handoff = f"transfer_to_{department}"
    if handoff in offered:
        return ToolCall(handoff, {})
    lookup, argument, reply = _LOOKUPS[department]
    if lookup not in offered:
        raise ValueError(f"a {department} question needs the handoff {handoff!r} or the tool {lookup!r}; "
                         f"the request offers {sorted(offered)}")
    result = _result_of(messages, lookup)
    if result is None:
        return ToolCall(lookup, {argument: subject})
    answer = SupportAnswer(department=department, reply=reply.format(subject, result.strip()))
    return json.dumps(answer.model_dump())


def support_expert() -> ScriptedExpert:
    """The expert, to serve with ``async with support_expert() as expert:``."""
    return ScriptedExpert(support_policy, name=EXPERT_NAME)
