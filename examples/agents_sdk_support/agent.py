"""The agent: an OpenAI Agents SDK support desk, a triage agent handing off to two specialists with tools.

Ordinary Agents SDK code, written as for an OpenAI model: ``Triage`` reads the customer's message and hands
off to ``Billing`` (tool: ``invoice_total``) or ``Technical`` (tool: ``service_status``); each specialist
looks the fact up and answers with a ``SupportAnswer`` (``output_type``: the department and the reply).

Reward, from the structured output alone: 0.5 when ``department`` is the right one, 0.5 when ``reply``
contains the fact the right tool returns (an invoice total, a service status). A run the SDK stops (no
output, unparseable output, too many turns) scores 0. Success (held-out): both halves.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal

from agents import Agent, ModelSettings, function_tool
from pydantic import BaseModel

from art_core import Trajectory

__all__ = ["MODEL_NAME", "SupportAnswer", "SupportTask", "build_agent", "make_tasks", "reward"]

MODEL_NAME = "support"

INVOICES = {f"INV-{1000 + k}": f"${(k * 37) % 400 + 20}.{(k * 13) % 100:02d}" for k in range(60)}
_STATUSES = ("operational", "degraded", "down")
# As many services as a warm start's demonstrations cover invoices, so that the technical desk's distinct turns
# weigh about as much as the billing desk's (with 8 services, 64 demonstrations held 8 distinct technical questions
# against 28 invoices, and the model sent half the service questions to Billing).
SERVICES = {service: _STATUSES[k % 3] for k, service in enumerate((
    "email", "billing portal", "login", "storage", "search", "video calls", "calendar", "chat", "file sharing",
    "payments", "notifications", "mobile app", "backups", "reports", "printing", "wifi", "vpn", "phone lines",
    "website", "api", "sync", "uploads", "dashboard", "single sign-on"))}


class SupportAnswer(BaseModel):
    department: Literal["billing", "technical"]
    reply: str


@function_tool
def invoice_total(invoice_id: str) -> str:
    """The total amount due on an invoice, e.g. invoice_id="INV-1042"."""
    return INVOICES.get(invoice_id.strip().upper(), f"no invoice {invoice_id!r}")


@function_tool
def service_status(service: str) -> str:
    """The current status of a service (operational, degraded or down)."""
    return SERVICES.get(service.strip().lower(), f"unknown service {service!r}")


def build_agent(*, max_tokens: int = 64, temperature: float = 1.0) -> Agent[Any]:
    """The triage agent, with its two specialists as handoffs."""
    # One call per turn (one handoff, one lookup): "one or more" let the small model write calls until max_tokens.
    settings = ModelSettings(max_tokens=max_tokens, temperature=temperature, parallel_tool_calls=False)
    billing = Agent(name="Billing", instructions="You handle invoices. Look the invoice up with invoice_total, "
                    "then answer with department 'billing' and the amount in the reply.",
                    tools=[invoice_total], output_type=SupportAnswer, model=MODEL_NAME, model_settings=settings)
    technical = Agent(name="Technical", instructions="You handle outages. Look the service up with service_status, "
                      "then answer with department 'technical' and its status in the reply.",
                      tools=[service_status], output_type=SupportAnswer, model=MODEL_NAME, model_settings=settings)
    # Triage must hand off (a handoff is a tool call: tool_choice="required"); which desk is the model's choice.
    return Agent(name="Triage", instructions="Hand questions about invoices to Billing and questions about "
                 "services that fail to Technical.", handoffs=[billing, technical], model=MODEL_NAME,
                 model_settings=settings.resolve(ModelSettings(tool_choice="required")))


@dataclass(frozen=True)
class SupportTask:
    message: str
    department: Literal["billing", "technical"]
    fact: str
    """What the right tool returns: the answer must contain it."""


def make_tasks(n: int, *, seed: int) -> list[SupportTask]:
    """``n`` customer messages, half about invoices, half about services."""
    rng = random.Random(seed)
    tasks = []
    for k in range(n):
        if k % 2 == 0:
            invoice = rng.choice(sorted(INVOICES))
            tasks.append(SupportTask(f"How much do I owe on invoice {invoice}?", "billing", INVOICES[invoice]))
        else:
            service = rng.choice(sorted(SERVICES))
            tasks.append(SupportTask(f"Is {service} working right now?", "technical", SERVICES[service]))
    return tasks


def reward(task: SupportTask) -> Any:
    """The reward function for one task: ``fn(trajectory, final_output) -> float``."""

    def score(trajectory: Trajectory, output: Any) -> float:
        right_department = isinstance(output, SupportAnswer) and output.department == task.department
        has_fact = isinstance(output, SupportAnswer) and task.fact.lower() in output.reply.lower()
        calls = [c for m in trajectory.messages for c in (m.tool_calls or [])]
        trajectory.metrics.update({"right_department": float(right_department), "has_fact": float(has_fact),
                                   "success": float(right_department and has_fact),
                                   "valid_tool_calls": float(output is not None and bool(calls))})
        return 0.5 * right_department + 0.5 * has_fact

    return score
