"""The tensors of a running decode batch: KV cache, attention mask and positions, for continuous batching.

Rows are left-padded to one width, so every row's next token goes in the same column. Rows can join
while others are half-way through, and finished rows leave at once (their cache rows are dropped, and so
are the leading columns no remaining row attends to). Positions are tracked per row, so padding never
shifts a row's rotary positions: each row computes exactly what it would compute alone.

Where the time goes, and what this module does about it (SmolLM2-135M, fp32, 2 CPU cores, 8 rows):

- A decode step is bound by reading the weights (matrix products are ~75% of it), so the rest must stay small.
  Each layer's keys and values live in a pre-allocated buffer with free columns on the right
  (``_SlotLayer``): a step writes one column in place instead of concatenating the whole cache (which was
  ~8% of a step), and the buffer is re-allocated only when it fills up or rows join.
- Prefill is the time to first token. Each distinct prompt of an admission is prefilled once (a GRPO group or
  a burst of sessions sends the same prompt many times), and a prompt seen before is not prefilled at all:
  its state comes from the engine's ``PrefixCache`` (``engines/_prefix.py``).

Joining needs plain ``DynamicLayer`` caches (full attention, as in Llama, Qwen2, Mistral without a sliding
window). For any other cache ``can_join`` is False and the engine admits new rows only into an empty
batch: static batching, still correct (and no prompt state is cached).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .._kv_cache import CACHE_ARG, cache_of
from ._prefix import PrefixCache, PromptState

__all__ = ["RunningBatch"]

_HEADROOM = 64
"""Free columns a cache buffer gets when it is (re-)allocated: steps before the next re-allocation."""


class RunningBatch:
    """The rows decoded together and their model state (blocking calls: run it off the event loop).

    Args:
        model: the causal LM.
        pad_id: the token id put in padding columns (never attended to).
        prefix: prompt states to reuse and fill (None: every prompt is prefilled).

    Attributes:
        logits: ``[rows, vocab]`` float32, each row's next-token logits (None while empty).
        can_join: whether rows can be added to a non-empty batch (see the module docstring).
        prefilled: prompts run through the model so far (a prompt taken from the prefix cache is not counted).
    """

    def __init__(self, model: Any, pad_id: int, prefix: PrefixCache | None = None) -> None:
        self.model = model
        self.pad_id = pad_id
        self.prefix = prefix
        self.device = next(model.parameters()).device
        self.logits: torch.Tensor | None = None
        self.can_join = True
        self.prefilled = 0
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
        """Add ``copies[i]`` rows for prompt ``i``, after the current rows (each distinct prompt prefilled once).

        Raises:
            RuntimeError: the batch is not empty and ``can_join`` is False (the caller checks first).
        """
        if len(self) and not self.can_join:
            raise RuntimeError("this model's cache cannot take rows into a running batch")
        keys = [tuple(p) for p in prompts]
        states: dict[tuple[int, ...], PromptState] = {}
        for key in dict.fromkeys(keys):
            state = self.prefix.get(key) if self.prefix is not None else None
            if state is not None:
                states[key] = state
        misses = [key for key in dict.fromkeys(keys) if key not in states]
        if misses:
            cache, attention, positions, logits = self._prefill(misses)
            self.prefilled += len(misses)
            if not _joinable(cache):  # static batching: this batch is empty (checked above); copy rows by index
                where = {key: i for i, key in enumerate(misses)}
                index = torch.tensor([where[key] for key, c in zip(keys, copies) for _ in range(c)], device=self.device)
                cache.batch_select_indices(index)
                self._cache, self._attention, self._positions = cache, attention[index], positions[index]
                self.logits, self.can_join = logits[index], False
                return
            width = attention.shape[1]
            for i, key in enumerate(misses):  # each prompt's own columns, unpadded: cached and joined alike
                start = width - len(key)
                state = PromptState(tuple((layer.keys[i, :, start:].clone(), layer.values[i, :, start:].clone())
                                          for layer in cache.layers), logits[i].clone())
                states[key] = state
                if self.prefix is not None:
                    self.prefix.put(key, state)
        self._join([states[key] for key, c in zip(keys, copies) for _ in range(c)])

    def _join(self, new: list[PromptState]) -> None:
        """Lay the old rows and the ``new`` ones right-aligned into fresh buffers with free columns on the right."""
        old = len(self)
        lengths = [s.layers[0][0].shape[-2] for s in new]
        width = max([self.width, *lengths])
        attention = torch.zeros((old + len(new), width), dtype=torch.long, device=self.device)
        layers = []
        for layer_index, (k0, v0) in enumerate(new[0].layers):
            heads, head_dim = k0.shape[0], k0.shape[-1]
            shape = (old + len(new), heads, width + _HEADROOM, head_dim)
            keys, values = k0.new_zeros(shape), v0.new_zeros(shape)
            if old:
                previous = self._cache.layers[layer_index]
                keys[:old, :, width - self.width:width] = previous.keys
                values[:old, :, width - self.width:width] = previous.values
            for row, (state, length) in enumerate(zip(new, lengths), start=old):
                k, v = state.layers[layer_index]
                keys[row, :, width - length:width] = k
                values[row, :, width - length:width] = v
            layers.append(_SlotLayer(keys, values, width))
        if old:
            assert self._attention is not None and self._positions is not None and self.logits is not None
            attention[:old, width - self.width:] = self._attention
        for row, length in enumerate(lengths, start=old):
            attention[row, width - length:] = 1
        positions = torch.tensor([[length - 1] for length in lengths], device=self.device)
        logits = torch.stack([s.logits for s in new])
        if self._cache is None:
            self._cache = DynamicCache()
        self._cache.layers = layers
        self._attention = attention
        self._positions = positions if not old else torch.cat([self._positions, positions])  # type: ignore[list-item]
        self.logits = logits if not old else torch.cat([self.logits, logits])  # type: ignore[list-item]

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
        if unused and self.can_join:  # trimming is the same slice on every layer: _SlotLayer only
            self._attention = self._attention[:, unused:]
            for layer in self._cache.layers:
                layer.trim_left(unused)

    def step(self, next_ids: torch.Tensor) -> None:
        """Feed each row its sampled token (``[rows]``) and compute the next logits."""
        assert self._attention is not None and self._positions is not None
        self._attention = torch.cat([self._attention, torch.ones_like(self._attention[:, :1])], dim=1)
        self._positions = self._positions + 1
        out = self.model(input_ids=next_ids[:, None].to(self.device), attention_mask=self._attention,
                         position_ids=self._positions, use_cache=True, **{CACHE_ARG: self._cache})
        self._cache, self.logits = cache_of(out), out.logits[:, -1].float()

    def _prefill(self, prompts: Sequence[Sequence[int]]) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
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
        return cache_of(out), attention, positions[:, -1:], out.logits[:, -1].float()


class _SlotLayer(DynamicLayer):
    """A full-attention cache layer in a pre-allocated ``[rows, heads, capacity, head_dim]`` buffer.

    Columns ``[start, end)`` hold the batch's tokens; ``keys``/``values`` are views of them. A step writes its
    column in place; the buffer is copied only when it is full (then it gets ``_HEADROOM`` free columns again).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, end: int) -> None:
        super().__init__()
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._keys, self._values, self._start, self._end = keys, values, 0, end
        self._views()

    def _views(self) -> None:
        self.keys = self._keys[:, :, self._start:self._end]
        self.values = self._values[:, :, self._start:self._end]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        new = key_states.shape[-2]
        if self._end + new > self._keys.shape[-2]:
            used = self._end - self._start
            shape = (*self._keys.shape[:2], used + new + _HEADROOM, self._keys.shape[-1])
            keys, values = self._keys.new_zeros(shape), self._values.new_zeros(shape)
            keys[:, :, :used], values[:, :, :used] = self.keys, self.values
            self._keys, self._values, self._start, self._end = keys, values, 0, used
        self._keys[:, :, self._end:self._end + new] = key_states
        self._values[:, :, self._end:self._end + new] = value_states
        self._end += new
        self._views()
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._keys, self._values = self._keys[indices], self._values[indices]
        self._views()

    def trim_left(self, columns: int) -> None:
        """Drop the ``columns`` leading columns (no row attends to them any more)."""
        self._start += columns
        self._views()


def _joinable(cache: Any) -> bool:
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
