"""The tensors of a running decode batch: KV cache, attention mask and positions, for continuous batching.

Rows are left-padded to one width, so every row's next token goes in the same column. Rows can join
while others are half-way through (their prompts are prefilled on their own, then both caches are
left-padded to a common width and stacked), and finished rows leave at once (their cache rows are
dropped, and so are the leading columns no remaining row attends to). Positions are tracked per row, so
padding never shifts a row's rotary positions: each row computes exactly what it would compute alone.

Joining needs plain ``DynamicLayer`` caches (full attention, as in Llama, Qwen2, Mistral without a sliding
window). For any other cache ``can_join`` is False and the engine admits new rows only into an empty
batch: static batching, still correct.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["RunningBatch"]


class RunningBatch:
    """The rows decoded together and their model state (blocking calls: run it off the event loop).

    Attributes:
        logits: ``[rows, vocab]`` float32, each row's next-token logits (None while empty).
        can_join: whether rows can be added to a non-empty batch (see the module docstring).
    """

    def __init__(self, model: Any, pad_id: int) -> None:
        self.model = model
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        self.logits: torch.Tensor | None = None
        self.can_join = True
        self._cache: Any = None
        self._attention: torch.Tensor | None = None  # [R, W] 1 where the row has a token
        self._positions: torch.Tensor | None = None  # [R, 1] position of each row's last token

    def __len__(self) -> int:
        return 0 if self._attention is None else self._attention.shape[0]

    @property
    def width(self) -> int:
        """Columns in the cache: the longest row plus the padding the rows still share."""
        return 0 if self._attention is None else self._attention.shape[1]

    def add(self, prompts: Sequence[list[int]], copies: Sequence[int]) -> None:
        """Prefill ``prompts`` (each once) and add ``copies[i]`` rows for prompt ``i``, after the current rows.

        Raises:
            RuntimeError: the batch is not empty and ``can_join`` is False (the caller checks first).
        """
        if len(self) and not self.can_join:
            raise RuntimeError("this model's cache cannot take rows into a running batch")
        cache, attention, positions, logits = self._prefill(prompts)
        if any(c != 1 for c in copies):  # n > 1: prefill a prompt once, then copy its state to its n rows
            index = torch.tensor([i for i, c in enumerate(copies) for _ in range(c)], device=self.device)
            cache.batch_select_indices(index)
            attention, positions, logits = attention[index], positions[index], logits[index]
        if not len(self):
            self._cache, self._attention, self._positions, self.logits = cache, attention, positions, logits
            self.can_join = _joinable(cache)
            return
        assert self._attention is not None and self._positions is not None and self.logits is not None
        width = max(self.width, attention.shape[1])
        for old_layer, new_layer in zip(self._cache.layers, cache.layers, strict=True):
            old_layer.keys = torch.cat([_pad_left(old_layer.keys, width, dim=-2),
                                        _pad_left(new_layer.keys, width, dim=-2)])
            old_layer.values = torch.cat([_pad_left(old_layer.values, width, dim=-2),
                                          _pad_left(new_layer.values, width, dim=-2)])
        self._attention = torch.cat([_pad_left(self._attention, width, dim=-1), _pad_left(attention, width, dim=-1)])
        self._positions = torch.cat([self._positions, positions])
        self.logits = torch.cat([self.logits, logits])

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in this order) and drop the leading columns none of them attends to."""
        if not rows:
            self._cache = self._attention = self._positions = self.logits = None
            self.can_join = True
            return
        assert self._attention is not None and self._positions is not None and self.logits is not None
        index = torch.tensor(rows, device=self.device)
        self._cache.batch_select_indices(index)
        self._attention, self._positions, self.logits = self._attention[index], self._positions[index], self.logits[index]
        unused = int(self._attention.any(dim=0).to(torch.int8).argmax())  # first column some row attends to
        if unused and self.can_join:  # trimming is the same slice on every layer: DynamicLayer only
            self._attention = self._attention[:, unused:]
            for layer in self._cache.layers:
                layer.keys, layer.values = layer.keys[..., unused:, :], layer.values[..., unused:, :]

    def step(self, next_ids: torch.Tensor) -> None:
        """Feed each row its sampled token (``[rows]``) and compute the next logits."""
        assert self._attention is not None and self._positions is not None
        self._attention = torch.cat([self._attention, torch.ones_like(self._attention[:, :1])], dim=1)
        self._positions = self._positions + 1
        out = self.model(input_ids=next_ids[:, None].to(self.device), attention_mask=self._attention,
                         position_ids=self._positions, past_key_values=self._cache, use_cache=True)
        self._cache, self.logits = out.past_key_values, out.logits[:, -1].float()

    def _prefill(self, prompts: Sequence[list[int]]) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):  # left padding: every prompt ends where decoding starts
            ids[i, width - len(prompt):] = torch.tensor(prompt)
            attention[i, width - len(prompt):] = 1
        ids, attention = ids.to(self.device), attention.to(self.device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)  # pads must not shift positions
        out = self.model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=True,
                         logits_to_keep=1)
        return out.past_key_values, attention, positions[:, -1:], out.logits[:, -1].float()


def _joinable(cache: Any) -> bool:
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _pad_left(tensor: torch.Tensor, width: int, *, dim: int) -> torch.Tensor:
    """Zero-pad ``tensor`` on the left of ``dim`` (-1 or -2) up to ``width``."""
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    return F.pad(tensor, (missing, 0) if dim == -1 else (0, 0, missing, 0))
