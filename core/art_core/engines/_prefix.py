"""Prompt states kept after prefill, so a prompt seen again skips its prefill (exact-match prefix cache).

A GRPO group sends the same prompt once per rollout, often a few milliseconds apart, and a client retrying
or a benchmark repeating sends it again later. The model's state after a prompt (each layer's keys and values,
unpadded, and the next-token logits) is the same every time for the same weights, so the engine keeps the
last few and copies them into the batch instead of running the prompt through the model again.

Entries are only valid for the weights they were computed with: the engine clears the cache whenever the
weights may change (``pause``, ``load_adapter``, ``mark_adapter_step``). The cache is bounded in bytes;
the least recently used prompts leave first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = ["PromptState", "PrefixCache"]


@dataclass(frozen=True)
class PromptState:
    """A prompt's model state after prefill.

    Attributes:
        layers: per layer, ``(keys, values)`` of shape ``[heads, prompt_len, head_dim]``, without padding.
        logits: ``[vocab]`` float32 next-token logits after the prompt's last token.
    """

    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    logits: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.logits.nbytes + sum(k.nbytes + v.nbytes for k, v in self.layers)


class PrefixCache:
    """Least-recently-used map from a prompt's token ids to its ``PromptState``, bounded in bytes.

    Args:
        max_bytes: total size of the kept states; 0 disables the cache (``get`` always misses).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], PromptState] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, prompt: tuple[int, ...]) -> PromptState | None:
        state = self._entries.get(prompt)
        if state is None:
            self.misses += 1
            return None
        self._entries.move_to_end(prompt)
        self.hits += 1
        return state

    def put(self, prompt: tuple[int, ...], state: PromptState) -> None:
        size = state.nbytes
        if size > self.max_bytes or prompt in self._entries:
            return
        self._entries[prompt] = state
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes

    def clear(self) -> None:
        """Forget every state (the weights changed, or may have)."""
        self._entries.clear()
        self._bytes = 0
