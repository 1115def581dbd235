"""Per-token log-probabilities of micro-batches, with a shared prefix run once.

``SharedPrefix`` runs a group's common prompt through the model once. Its outputs (each layer's keys and
values, and the logits at its last position) are handed to the micro-batches as detached leaf tensors:
every micro-batch expands them to its batch size (a view, no copy), runs only its own suffix tokens, and
backpropagates into those leaves. ``SharedPrefix.backward()`` then sends the accumulated gradients
through the prefix's graph once. The result equals running each full sequence separately (values exact,
gradients to float rounding; see tests/training/test_forward.py) at a fraction of the work when the
prompt is long, and the memory held at any time is one prefix graph plus one micro-batch graph.

Prefixes nest the same way: a group's prefix built on the step's root prefix (``parent``: the prompt every group
of the step starts with) runs only its own tokens on the root's cache and backpropagates into the root's leaves;
the root's ``backward()`` runs once, after every group's. The root's graph is then held for the whole step, beside
one group's prefix graph and one micro-batch graph.

Both forwards run PEFT's LoRA layers fused (``fused_lora.py``) and keep fewer activations (``lean_forward.py``:
the memory patches, apart from the math here). ``SwiGLU``, ``lean_mlp`` and ``native_gqa_attention`` are
re-exported from there, where they lived before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .._kv_cache import CACHE_ARG, cache_of
from .batching import MicroBatch
from .fused_lora import fused_lora, head_copy
from .lean_forward import SwiGLU, lean_forward, lean_mlp, native_gqa_attention

__all__ = [
    "ChunkedTokenLogprobs",
    "PrefixBatch",
    "SharedPrefix",
    "SwiGLU",
    "TokenLogprobs",
    "chunked_token_logprobs",
    "lean_mlp",
    "micro_batch_logprobs",
    "native_gqa_attention",
]

# The LM head's chunks are sized in bytes: each chunk holds two [rows, vocab] temporaries (the log-softmax and the
# softmax), each made just over 32 MiB, glibc's ceiling for serving an allocation from the heap. Larger ones are
# always their own mapping, handed back to the system when freed; smaller ones (24 MiB) are cut from the heap, which
# fragments it and keeps them resident after the step (measured: +70 MiB of heap per step). Rows for SmolLM2's
# 49k vocabulary in fp32: 171; three temporaries of 256 rows (48 MiB each) was the old peak.
LOGPROB_CHUNK_BYTES = 32 * 2**20 + 1
LOGPROB_CHUNK = "auto"


@dataclass
class TokenLogprobs:
    logprobs: torch.Tensor  # [B, T]; position t holds log p(token t | tokens < t) where trained, else 0
    entropy: torch.Tensor | None  # [B, T] detached, only where trained (0 elsewhere); None when not asked


class _PromptStates:
    """What a prompt forward leaves for the micro-batches that continue it: its last logits and its keys and
    values, as detached leaves the micro-batches backpropagate into, so that the prompt's graph survives several
    micro-batches and is walked only once, in ``backward()``."""

    ids: list[int]
    length: int  # the cache's positions

    def _keep(self, outputs: list[torch.Tensor], grad: bool) -> None:
        """``outputs``: the last logits, then each layer's keys and values."""
        self._grad = grad
        self._outputs = outputs
        self._leaves = [t.detach().requires_grad_(grad) for t in outputs]

    @property
    def last_logits(self) -> torch.Tensor:
        return self._leaves[0]

    def _cache(self, rows_of: Callable[[torch.Tensor], torch.Tensor], config: object) -> DynamicCache:
        kv = self._leaves[1:]
        pairs = [(rows_of(kv[i]), rows_of(kv[i + 1])) for i in range(0, len(kv), 2)]
        return DynamicCache(ddp_cache_data=pairs, config=config)

    def backward(self) -> None:
        """Send the gradients the micro-batches left on the leaves through the prompt's graph."""
        if not self._grad:
            return
        pairs = [(out, leaf.grad) for out, leaf in zip(self._outputs, self._leaves) if leaf.grad is not None]
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        self._outputs, self._leaves = [], []


class SharedPrefix(_PromptStates):
    """A prompt shared by several sequences, run once.

    Args:
        model: a causal LM (PEFT-wrapped or not).
        prefix_ids: the shared tokens (at least one).
        grad: build a graph so micro-batches can backpropagate into the prefix.
        parent: a prefix that ``prefix_ids`` starts with (and extends by at least one token): only the tokens
            after it are run, on its cache, and this prefix's ``backward()`` sends its share of the gradients
            into the parent's leaves (call the parent's ``backward()`` after all of its children's).

    Raises:
        ValueError: ``prefix_ids`` does not extend ``parent``'s tokens.
    """

    def __init__(self, model: torch.nn.Module, prefix_ids: list[int], *, grad: bool,
                 parent: SharedPrefix | None = None) -> None:
        self.ids, self.length = list(prefix_ids), len(prefix_ids)
        device = _device(model)
        start, kwargs = 0, {}
        if parent is not None:
            if parent.length >= self.length or self.ids[:parent.length] != parent.ids:
                raise ValueError(f"a prefix of {self.length} tokens does not extend its parent's "
                                 f"{parent.length}: build it without the parent")
            start = parent.length
            kwargs = {CACHE_ARG: parent.cache_for(1, model.config),
                      "position_ids": torch.arange(start, self.length, device=device)[None]}
        ids = torch.tensor([self.ids[start:]], device=device)
        with torch.set_grad_enabled(grad), fused_lora(model), lean_forward(model):
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **kwargs)
        outputs: list[torch.Tensor] = [out.logits[0, -1]]  # [V]: predicts the first token after the prefix
        for layer in cache_of(out).layers:
            outputs += [layer.keys, layer.values]  # [1, kv_heads, P, head_dim] each
        self._keep(outputs, grad)

    def cache_for(self, batch_size: int, config: object) -> DynamicCache:
        """The cache for a micro-batch of ``batch_size`` rows that all continue this prefix (views, no copy)."""
        return self._cache(lambda t: t.expand(batch_size, -1, -1, -1), config)


class PrefixBatch(_PromptStates):
    """Several prompts run as one batch (``batching.PackedGroups``): row g of the cache is prompt g's, right-padded
    to the longest. A micro-batch whose rows continue different prompts takes each row's (``cache_for_rows``).

    The same values as running each prompt as a ``SharedPrefix`` (padding is masked, positions are each prompt's
    own), gradients to float rounding; one forward of all the prompts' tokens makes larger matrix products.

    Args:
        model: a causal LM (PEFT-wrapped or not).
        prefixes: the prompts (at least one token each).
        grad: build a graph so micro-batches can backpropagate into the prompts.
        parent: a prefix every prompt extends by at least one token (the step's root): only the tokens after it
            are run, on its cache; ``backward()`` sends the prompts' share of the gradients into its leaves.
        pad_token_id: the id run in padding positions (masked out; any valid id works).

    Raises:
        ValueError: a prompt does not extend ``parent``'s tokens.
    """

    def __init__(self, model: torch.nn.Module, prefixes: list[list[int]], *, grad: bool,
                 parent: SharedPrefix | None = None, pad_token_id: int = 0) -> None:
        device = _device(model)
        self.prefixes = [list(p) for p in prefixes]
        self.ids = self.prefixes[0]
        self.length = max(len(p) for p in self.prefixes)  # the cache's positions (shorter prompts are padded)
        self.lengths = torch.tensor([len(p) for p in self.prefixes], device=device)  # [G]
        start, rows = (parent.length if parent is not None else 0), len(self.prefixes)
        if parent is not None and any(len(p) <= start or p[:start] != parent.ids for p in self.prefixes):
            raise ValueError(f"every prompt of a PrefixBatch must extend its parent's {start} tokens by at least "
                             "one: build it without the parent")
        ids = torch.full((rows, self.length - start), pad_token_id, dtype=torch.long)
        attention = torch.zeros((rows, self.length), dtype=torch.long)
        for g, prompt in enumerate(self.prefixes):
            ids[g, : len(prompt) - start] = torch.tensor(prompt[start:])
            attention[g, : len(prompt)] = 1
        kwargs: dict[str, object] = {
            "attention_mask": attention.to(device),
            "position_ids": torch.arange(start, self.length, device=device).expand(rows, -1)}
        if parent is not None:
            kwargs[CACHE_ARG] = parent.cache_for(rows, model.config)
        last = self.lengths - start - 1  # each prompt's last position in this forward
        keep = torch.unique(last)  # sorted: the positions whose logits are wanted
        with torch.set_grad_enabled(grad), fused_lora(model), lean_forward(model, start):
            out = model(input_ids=ids.to(device), use_cache=True, logits_to_keep=keep, **kwargs)
        # [G, V]: row g predicts the first token after prompt g
        outputs = [out.logits[torch.arange(rows, device=device), torch.searchsorted(keep, last)]]
        for layer in cache_of(out).layers:
            outputs += [layer.keys, layer.values]  # [G, kv_heads, P, head_dim] each
        self._keep(outputs, grad)

    def cache_for_rows(self, rows: torch.Tensor, config: object) -> DynamicCache:
        """The cache for a micro-batch whose row i continues prompt ``rows[i]`` (a copy of each row's prompt)."""
        return self._cache(lambda t: t.index_select(0, rows), config)


def micro_batch_logprobs(
    model: torch.nn.Module,
    batch: MicroBatch,
    prefix: SharedPrefix | PrefixBatch | None,
    *,
    with_entropy: bool = False,
    chunk_size: int | str | None = LOGPROB_CHUNK,
) -> TokenLogprobs:
    """Log-probabilities of a micro-batch's trained tokens under ``model``.

    Only positions that carry a loss (``batch.trained``) get a log-prob; every other position holds 0.
    For a plain LM head (a frozen linear layer without bias or logit scaling, as every Llama/Qwen-style
    model here), the head and the log-softmax run on chunks of ``chunk_size`` trained positions
    (``ChunkedTokenLogprobs``): no ``[B, T, vocab]`` tensor is ever built, nor kept for the backward
    pass. Any other head, or a model sharded with FSDP2 (whose root unit gathers the head only in the whole
    model's forward), falls back to the full logits (same values, more memory).

    Args:
        model: the causal LM.
        batch: suffixes of one prefix group (``batch.input_ids`` is [B, T]), or of packed groups
            (``batch.prefix_rows``).
        prefix: the group's shared prefix, or None when the sequences start at position 0; for packed groups,
            their ``PrefixBatch``.
        with_entropy: also return the policy's entropy at trained positions (for monitoring).
        chunk_size: trained positions per chunk of the LM head (bounds its memory to chunk x vocab); ``"auto"``
            sizes chunks by ``LOGPROB_CHUNK_BYTES``; None takes the model's full logits instead (the reference path,
            kept for heads the chunked one cannot run).

    Returns:
        ``TokenLogprobs``: ``logprobs`` [B, T] with a gradient, ``entropy`` [B, T] detached or None.
    """
    device = _device(model)
    ids = batch.input_ids.to(device)  # [B, T]
    attention = batch.attention_mask.to(device)  # [B, T]
    b, t = ids.shape
    head = plain_head(model) if chunk_size is not None else None
    kwargs: dict[str, object] = {"attention_mask": attention, "use_cache": False}
    prompt_rows = batch.prefix_rows.to(device) if batch.prefix_rows is not None else None  # [B] or None
    shared_length = 0  # the prefix every row shares (lean_forward keeps one copy of it)
    if prefix is not None and isinstance(prefix, PrefixBatch) != (prompt_rows is not None):
        raise ValueError("a micro-batch of packed groups (prefix_rows) runs behind their PrefixBatch, and only it")
    if prefix is not None and prompt_rows is not None:  # each row continues its own prompt of a PrefixBatch
        p, starts = prefix.length, prefix.lengths[prompt_rows]  # [B]
        kwargs["position_ids"] = starts[:, None] + torch.arange(t, device=device)
        own = (torch.arange(p, device=device) < starts[:, None]).to(attention.dtype)  # [B, P]: padding masked
        kwargs["attention_mask"] = torch.cat([own, attention], dim=1)
        kwargs[CACHE_ARG] = prefix.cache_for_rows(prompt_rows, model.config)
    elif prefix is not None:
        p = shared_length = prefix.length
        kwargs["position_ids"] = torch.arange(p, p + t, device=device).expand(b, t)
        kwargs["attention_mask"] = torch.cat([torch.ones(b, p, dtype=attention.dtype, device=device), attention], dim=1)
        kwargs[CACHE_ARG] = prefix.cache_for(b, model.config)
    # Trained positions 1..T-1, found on the host (batch tensors live there): no device sync.
    rows, cols = batch.trained[:, 1:].nonzero(as_tuple=True)  # position cols+1 is predicted by cols
    rows, cols = rows.to(device), cols.to(device)
    targets = ids[rows, cols + 1]  # [N]

    lean = lean_forward(model, shared_length)
    if head is None:  # a head with extras (bias, scaling, soft-capping): take the model's own logits
        with fused_lora(model), lean:
            logits = model(input_ids=ids, **kwargs).logits  # [B, T, V]
        picked = logits[rows, cols]  # [N, V]
        rest = _selected_logprobs(picked, targets)  # [N]
        rest_entropy = _entropy(picked.detach()) if with_entropy else None
    else:
        with fused_lora(model), lean:
            hidden = _decoder(model)(input_ids=ids, **kwargs).last_hidden_state  # [B, T, H]
        rest, rest_entropy = chunked_token_logprobs(hidden[rows, cols], head.weight, targets,
                                                    chunk_size=chunk_size, with_entropy=with_entropy)

    logprobs = torch.zeros(b, t, device=device, dtype=rest.dtype).index_put((rows, cols + 1), rest)
    entropy = None
    if with_entropy:
        entropy = torch.zeros(b, t, device=device, dtype=rest.dtype)
        entropy[rows, cols + 1] = rest_entropy
    if prefix is not None and prompt_rows is not None:
        first = prefix.last_logits[prompt_rows]  # [B, V]: row i's prompt predicts its suffix token 0
        first_lp = first.gather(1, ids[:, :1])[:, 0] - torch.logsumexp(first, dim=-1)  # [B]
        keep0 = batch.trained[:, 0].to(device) > 0  # [B]
        logprobs = torch.cat([torch.where(keep0, first_lp, 0.0)[:, None], logprobs[:, 1:]], dim=1)
        if entropy is not None:
            entropy[:, 0] = torch.where(keep0, _entropy(first.detach()), 0.0)
    elif prefix is not None:
        first = prefix.last_logits  # [V] predicts suffix token 0 of every row
        first_lp = first[ids[:, 0]] - torch.logsumexp(first, dim=-1)  # [B]
        keep0 = batch.trained[:, 0].to(device) > 0  # [B]
        logprobs = torch.cat([torch.where(keep0, first_lp, 0.0)[:, None], logprobs[:, 1:]], dim=1)
        if entropy is not None:
            entropy[:, 0] = torch.where(keep0, _entropy(first.detach()[None])[0], 0.0)
    return TokenLogprobs(logprobs, entropy)


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int | str = LOGPROB_CHUNK,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(hidden @ weight.T)[i, targets[i]]`` for each row, a chunk of rows at a time.

    Args:
        hidden: ``[N, H]`` final hidden states (after the model's last norm); may carry a gradient.
        weight: ``[V, H]`` the LM head's weight; must not require a gradient (frozen, as under LoRA).
        targets: ``[N]`` token ids.
        chunk_size: rows per chunk (the largest temporary is ``chunk_size x V``), or ``"auto"``: as many rows as make
            a temporary just over ``LOGPROB_CHUNK_BYTES``.
        with_entropy: also return each row's entropy (detached).

    Returns:
        (log-probs ``[N]`` with a gradient to ``hidden``, entropies ``[N]`` or None).

    Raises:
        ValueError: ``weight`` requires a gradient (this path does not compute one).
    """
    if weight.requires_grad:
        raise ValueError("chunked_token_logprobs does not train the LM head; use the model's logits instead")
    if chunk_size == "auto":
        chunk_size = LOGPROB_CHUNK_BYTES // (weight.shape[0] * hidden.element_size()) + 1
    elif not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows or 'auto', not {chunk_size!r}")
    logprobs, entropy = ChunkedTokenLogprobs.apply(hidden, weight, targets, chunk_size, with_entropy)
    return logprobs, (entropy if with_entropy else None)


class ChunkedTokenLogprobs(torch.autograd.Function):
    """Chunked LM head + log-softmax whose backward needs no ``[N, V]`` tensor.

    The log-prob of token y at one position depends only on that position's hidden state h:
    ``d logp / d h = W[y] - softmax(W h) @ W``. That ``[H]`` vector is computed in the forward pass, from the
    chunk's logits while they exist, so the backward is a scaling of saved ``[N, H]`` rows: the work is the
    same two ``[c, H] x [H, V]``-sized products as autograd's forward + backward, the memory is one chunk.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, with_entropy):  # type: ignore[override]
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n)
        entropy = hidden.new_zeros(n if with_entropy else 0)
        grad_rows = hidden.new_empty(hidden.shape) if ctx.needs_input_grad[0] else None
        # The chunk's two [c, V] tensors, allocated once and reused by every chunk: each is its own mapping (see
        # LOGPROB_CHUNK_BYTES), and a fresh one per chunk would cost a page fault per 4 KiB, every chunk. With a
        # packed copy of the head (prepacked base weights) oneDNN allocates the logits itself, still twice as fast.
        packed = head_copy(weight)
        rows = min(chunk_size, n)
        logits_buffer = hidden.new_empty(rows, weight.shape[0]) if packed is None else None
        log_softmax_buffer = hidden.new_empty(rows, weight.shape[0])
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            if packed is None:
                logits = torch.mm(hidden[start:stop], weight.t(), out=logits_buffer[: stop - start])  # [c, V]
            else:
                logits = packed.product(hidden[start:stop], None)
            # log_softmax: one kernel (max, sum of exps, write) where logsumexp needs temporaries and a subtraction
            log_softmax = torch.log_softmax(logits, dim=-1, out=log_softmax_buffer[: stop - start])  # [c, V]
            tgt = targets[start:stop]
            logprobs[start:stop] = log_softmax.gather(-1, tgt[:, None])[:, 0]
            if with_entropy or grad_rows is not None:
                probs = torch.exp(log_softmax, out=logits)  # [c, V] softmax, in the logits' memory
                if grad_rows is not None:
                    expected = probs @ weight if packed is None else packed.grad_input(probs)  # [c, H]
                    torch.sub(weight[tgt], expected, out=grad_rows[start:stop])
                if with_entropy:  # -sum_v p log p, summed as the full-logits path sums it; in place: no third [c, V]
                    entropy[start:stop] = -log_softmax.mul_(probs).sum(-1)
        ctx.save_for_backward(grad_rows)
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):  # type: ignore[override]
        (grad_rows,) = ctx.saved_tensors
        grad_hidden = grad_rows * grad_logprobs[:, None] if grad_rows is not None else None
        return grad_hidden, None, None, None, None


def plain_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The LM head when logits are exactly ``head(last_hidden_state)`` and the head is frozen, else None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    extras = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
    if (type(head) is not torch.nn.Linear or head.bias is not None or head.weight.requires_grad
            or any(getattr(config, name, None) not in (None, 1, 1.0) for name in extras)
            or not hasattr(_decoder(model), "forward") or _sharded(model)):
        return None
    return head


def _sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 shards the model: its root unit gathers the head only in the whole model's forward."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return isinstance(base, FSDPModule) or isinstance(model, FSDPModule)


def _decoder(model: torch.nn.Module) -> torch.nn.Module | None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT wraps the HF model
    get = getattr(base, "get_decoder", None)
    return get() if callable(get) else None


def _selected_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # The same kernel as the chunked path's (logsumexp's temporary is as large, and rounds differently).
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [N]


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    return -(logp.exp() * logp).sum(-1)  # [N]


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
