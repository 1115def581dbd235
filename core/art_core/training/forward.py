"""Per-token log-probabilities of micro-batches, with a shared prefix run once.

``SharedPrefix`` runs a group's common prompt through the model once. Its outputs (each layer's keys and
values, and the logits at its last position) are handed to the micro-batches as detached leaf tensors:
every micro-batch expands them to its batch size (a view, no copy), runs only its own suffix tokens, and
backpropagates into those leaves. ``SharedPrefix.backward()`` then sends the accumulated gradients
through the prefix's graph once. The result equals running each full sequence separately (values exact,
gradients to float rounding; see tests/training/test_forward.py) at a fraction of the work when the
prompt is long, and the memory held at any time is one prefix graph plus one micro-batch graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .batching import MicroBatch

__all__ = ["SharedPrefix", "TokenLogprobs", "micro_batch_logprobs"]


@dataclass
class TokenLogprobs:
    logprobs: torch.Tensor  # [B, T]; position t holds log p(token t | tokens < t); 0 where nothing predicts it
    entropy: torch.Tensor | None  # [B, T] detached, only where trained (0 elsewhere); None when not asked


class SharedPrefix:
    """A prompt shared by several sequences, run once.

    Args:
        model: a causal LM (PEFT-wrapped or not).
        prefix_ids: the shared tokens (at least one).
        grad: build a graph so micro-batches can backpropagate into the prefix.
    """

    def __init__(self, model: torch.nn.Module, prefix_ids: list[int], *, grad: bool) -> None:
        self.length = len(prefix_ids)
        ids = torch.tensor([prefix_ids], device=_device(model))
        with torch.set_grad_enabled(grad):
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        self._grad = grad
        self._outputs: list[torch.Tensor] = [out.logits[0, -1]]  # [V]
        for layer in out.past_key_values.layers:
            self._outputs += [layer.keys, layer.values]  # [1, kv_heads, P, head_dim] each
        # Detached leaves: micro-batches backpropagate into these, not into the prefix's graph, so
        # the graph survives several micro-batches and is walked only once, in backward().
        self._leaves = [t.detach().requires_grad_(grad) for t in self._outputs]

    @property
    def last_logits(self) -> torch.Tensor:
        return self._leaves[0]  # [V]

    def cache_for(self, batch_size: int, config: object) -> DynamicCache:
        kv = self._leaves[1:]
        pairs = [(kv[i].expand(batch_size, -1, -1, -1), kv[i + 1].expand(batch_size, -1, -1, -1))
                 for i in range(0, len(kv), 2)]
        return DynamicCache(ddp_cache_data=pairs, config=config)

    def backward(self) -> None:
        """Send the gradients the micro-batches left on the leaves through the prefix's graph."""
        if not self._grad:
            return
        pairs = [(out, leaf.grad) for out, leaf in zip(self._outputs, self._leaves) if leaf.grad is not None]
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        self._outputs, self._leaves = [], []


def micro_batch_logprobs(
    model: torch.nn.Module,
    batch: MicroBatch,
    prefix: SharedPrefix | None,
    *,
    with_entropy: bool = False,
) -> TokenLogprobs:
    """Log-probabilities of a micro-batch's tokens under ``model``.

    Args:
        model: the causal LM.
        batch: suffixes of one prefix group (``batch.input_ids`` is [B, T]).
        prefix: the group's shared prefix, or None when the sequences start at position 0.
        with_entropy: also return the policy's entropy at trained positions (for monitoring).
    """
    device = _device(model)
    ids = batch.input_ids.to(device)  # [B, T]
    attention = batch.attention_mask.to(device)  # [B, T]
    b, t = ids.shape
    if prefix is None:
        out = model(input_ids=ids, attention_mask=attention, use_cache=False)
        logits = out.logits[:, :-1]  # [B, T-1, V] predicts tokens 1..T-1
        first = None
    else:
        p = prefix.length
        positions = torch.arange(p, p + t, device=device).expand(b, t)
        full_attention = torch.cat([torch.ones(b, p, dtype=attention.dtype, device=device), attention], dim=1)
        out = model(input_ids=ids, attention_mask=full_attention, position_ids=positions,
                    past_key_values=prefix.cache_for(b, model.config), use_cache=False)
        logits = out.logits[:, :-1]  # [B, T-1, V] predicts suffix tokens 1..T-1
        first = prefix.last_logits  # [V] predicts suffix token 0 of every row

    logprobs = torch.zeros(b, t, device=device, dtype=logits.dtype)
    rest = _selected_logprobs(logits, ids[:, 1:])  # [B, T-1]
    if first is None:
        logprobs = torch.cat([logprobs[:, :1], rest], dim=1)
    else:
        head = first[ids[:, 0]] - torch.logsumexp(first, dim=-1)  # [B]
        logprobs = torch.cat([head[:, None], rest], dim=1)

    entropy = None
    if with_entropy:
        entropy = torch.zeros(b, t, device=device)
        with torch.no_grad():
            trained = batch.trained.to(device) > 0
            rest_mask = trained[:, 1:]
            if rest_mask.any():
                entropy[:, 1:][rest_mask] = _entropy(logits[rest_mask].detach())
            if first is not None and trained[:, 0].any():
                entropy[:, 0][trained[:, 0]] = _entropy(first.detach()[None])[0]
    return TokenLogprobs(logprobs, entropy)


def _selected_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # log_softmax(x)[y] = x[y] - logsumexp(x): avoids materialising a second [B, T, V] tensor.
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, T]
    return picked - torch.logsumexp(logits, dim=-1)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    return -(logp.exp() * logp).sum(-1)  # [N]


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
