"""The name a model's forward takes its KV cache by, and returns it under.

transformers 5 renamed the argument and the output field from ``past_key_values`` to ``cache``; the old name still
works but warns (a ``FutureWarning`` and a log line in every process) and goes in transformers 5.40. We support
releases on both sides of the rename (``transformers>=4.56``), so the name is the one the installed release's
output classes declare.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from transformers.modeling_outputs import CausalLMOutputWithPast

__all__ = ["CACHE_ARG", "cache_of"]

CACHE_ARG = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} else "past_key_values"
"""The keyword of a model's ``forward`` that takes a KV cache, and the output field that returns it."""


def cache_of(output: Any) -> Any:
    """The KV cache a forward with ``use_cache=True`` returned."""
    return getattr(output, CACHE_ARG)
