"""Counters the gateway exposes at ``GET /metrics`` (JSON), for dashboards and tests."""

from __future__ import annotations

from collections import Counter
from typing import Any

__all__ = ["GatewayMetrics"]


class GatewayMetrics:
    """Plain counters, updated from the event loop only (no lock needed)."""

    def __init__(self) -> None:
        self.requests = 0
        """HTTP requests received, any route, any outcome."""
        self.errors_by_status: Counter[int] = Counter()
        """Responses with status >= 400, by status code."""
        self.completions = 0
        """Chat completion requests answered (each may hold ``n`` choices)."""
        self.prompt_tokens = 0
        self.completion_tokens = 0
        """Tokens generated, over all choices."""
        self.tool_calls = 0
        """Tool calls returned to clients."""
        self.tool_call_parse_errors = 0
        """Tool-call markup the model wrote that could not be parsed (returned as content instead)."""
        self.records_written = 0
        self.completions_cancelled = 0
        """Requests stopped before their end (client gone, task cancelled); recorded with the tokens so far."""

    def snapshot(self) -> dict[str, Any]:
        """The counters as a JSON-ready dict."""
        return {
            "requests": self.requests,
            "errors": {str(status): count for status, count in sorted(self.errors_by_status.items())},
            "completions": self.completions,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "tool_calls": self.tool_calls,
            "tool_call_parse_errors": self.tool_call_parse_errors,
            "records_written": self.records_written,
            "completions_cancelled": self.completions_cancelled,
        }
