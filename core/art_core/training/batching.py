"""Samples -> micro-batches, sharing each group's common prompt, and the prompt all groups share.

The completions of a GRPO group sit behind the same prompt (an agent's system prompt, tool schemas and
task are often most of the tokens). Instead of running that prompt once per completion, a group's
longest common token prefix is run once and its key/value cache is reused by every completion
(``training/forward.py``). The remaining suffixes are packed into micro-batches whose padded size stays
under a token budget, so memory is bounded whatever the group size.

The groups of one step usually differ only in their task: the system prompt and tool schemas before it are the
same in every group. That part, the step's root prefix (``PrefixGroup.root_length``), is run once for the whole
step and each group's prefix continues from its cache, so a step runs the system prompt once, not once per group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .samples import Sample

__all__ = ["MicroBatch", "PackedGroups", "PrefixGroup", "plan_micro_batches"]


@dataclass
class MicroBatch:
    """Suffixes of some samples of one prefix group, right-padded to a common length T."""

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long, 1 = real token
    trained: torch.Tensor  # [B, T] float, 1 = token sampled by the model (loss applies)
    advantages: torch.Tensor  # [B, T] float
    sampler_logprobs: torch.Tensor  # [B, T] float, NaN where unknown
    samples: list[Sample]
    behaviour_logprobs: torch.Tensor | None = None
    """[B, T] float, the behaviour policy's log-probs where a sample gave them (NaN elsewhere); None when no
    sample of the micro-batch did (on-policy: no tensor is built)."""
    prefix_rows: torch.Tensor | None = None
    """[B] long, in a ``PackedGroups``: the prefix (index into ``PackedGroups.prefixes``) each row continues;
    None: every row continues its ``PrefixGroup``'s one prefix."""

    @property
    def padded_tokens(self) -> int:
        return self.input_ids.numel()


@dataclass
class PrefixGroup:
    """Micro-batches whose samples all start with ``prefix_ids`` (empty: nothing shared)."""

    prefix_ids: list[int]
    micro_batches: list[MicroBatch] = field(default_factory=list)
    root_length: int = 0
    """Leading tokens of ``prefix_ids`` that every sharing group of the step starts with (the step's root prefix,
    run once for all of them); always shorter than ``prefix_ids``. 0: this group's prefix runs on its own."""


@dataclass
class PackedGroups:
    """Several groups run together: their prefixes as one batch, their suffixes in shared micro-batches (each row
    continues the prefix its ``MicroBatch.prefix_rows`` names)."""

    prefixes: list[list[int]]
    """Each group's prefix (at least one token each, all starting with the same ``root_length`` tokens)."""
    micro_batches: list[MicroBatch] = field(default_factory=list)
    root_length: int = 0
    """As ``PrefixGroup.root_length``: the leading tokens every prefix shares, run once before them."""


def plan_micro_batches(
    groups: Sequence[Sequence[Sample]],
    *,
    token_budget: int,
    share_prefix: bool = True,
    min_shared_prefix: int = 16,
    pad_token_id: int = 0,
    pack_groups: bool = False,
) -> list[PrefixGroup | PackedGroups]:
    """Plan the forward passes of one optimizer step.

    Args:
        groups: the samples of each trajectory group (advantages already set).
        token_budget: most padded suffix tokens in one micro-batch (B * T); one sample longer than this
            still gets a micro-batch of its own.
        share_prefix: run each group's common prompt once (exact; off only to compare).
        min_shared_prefix: below this many common tokens, sharing saves less than it costs.
        pad_token_id: id put in padding positions (masked out; any valid id works).
        pack_groups: pack the groups into one ``PackedGroups`` when every group has a shared prefix and packing
            needs fewer micro-batches (a packed row also holds a copy of its prefix's cache: its tokens count
            against ``token_budget``).

    Returns:
        One ``PrefixGroup`` per input group with at least one sample, or one ``PackedGroups`` holding them all.
        With ``share_prefix``, when two or more groups' prefixes start with the same ``min_shared_prefix`` tokens
        or more, each of them gets that common start as its ``root_length``.
    """
    planned = []
    for samples in groups:
        if not samples:
            continue
        prefix_len = _shared_prefix_length(samples) if share_prefix and len(samples) > 1 else 0
        if prefix_len < min_shared_prefix:
            prefix_len = 0
        group = PrefixGroup(prefix_ids=list(samples[0].token_ids[:prefix_len]))
        # Longest first so each micro-batch holds suffixes of similar length (little padding).
        ordered = sorted(samples, key=lambda s: len(s.token_ids), reverse=True)
        current: list[Sample] = []
        for sample in ordered:
            longest = len(current[0].token_ids) - prefix_len if current else len(sample.token_ids) - prefix_len
            if current and longest * (len(current) + 1) > token_budget:
                group.micro_batches.append(_collate(current, prefix_len, pad_token_id))
                current = []
            current.append(sample)
        group.micro_batches.append(_collate(current, prefix_len, pad_token_id))
        planned.append(group)
    if share_prefix:
        _share_root(planned, min_shared_prefix)
        if pack_groups and len(planned) > 1 and all(g.prefix_ids for g in planned):
            packed = _pack(planned, token_budget, pad_token_id)
            if len(packed.micro_batches) < sum(len(g.micro_batches) for g in planned):
                return [packed]
    return planned


def _pack(planned: list[PrefixGroup], token_budget: int, pad_token_id: int) -> PackedGroups:
    """The groups' samples in shared micro-batches, longest suffix first; a row costs its suffix and the padded
    prefix cache it gets a copy of."""
    prefix_width = max(len(g.prefix_ids) for g in planned)
    rows = [(len(s.token_ids) - len(g.prefix_ids), i, s)
            for i, g in enumerate(planned) for mb in g.micro_batches for s in mb.samples]
    rows.sort(key=lambda row: row[0], reverse=True)
    packed = PackedGroups(prefixes=[g.prefix_ids for g in planned], root_length=planned[0].root_length)
    current: list[tuple[int, int, Sample]] = []
    for row in rows:
        widest = current[0][0] if current else row[0]
        if current and (prefix_width + widest) * (len(current) + 1) > token_budget:
            packed.micro_batches.append(_collate_packed(current, packed.prefixes, pad_token_id))
            current = []
        current.append(row)
    packed.micro_batches.append(_collate_packed(current, packed.prefixes, pad_token_id))
    return packed


def _collate_packed(rows: list[tuple[int, int, Sample]], prefixes: list[list[int]], pad_token_id: int) -> MicroBatch:
    samples = [sample for _, _, sample in rows]
    batch = _collate(samples, [len(prefixes[group]) for _, group, _ in rows], pad_token_id)
    batch.prefix_rows = torch.tensor([group for _, group, _ in rows], dtype=torch.long)
    return batch


def _share_root(planned: list[PrefixGroup], min_shared_prefix: int) -> None:
    """Give the groups with a prefix their longest common start as ``root_length`` (when it is long enough).

    Each group keeps at least one prefix token of its own: the logits at its prefix's last position predict its
    first suffix token, and they come from the group's own forward.
    """
    prefixes = [g.prefix_ids for g in planned if g.prefix_ids]
    if len(prefixes) < 2:
        return
    n = _common_start(prefixes, min(len(p) for p in prefixes) - 1)
    if n >= min_shared_prefix:
        for group in planned:
            if group.prefix_ids:
                group.root_length = n


def _common_start(sequences: Sequence[Sequence[int]], limit: int) -> int:
    """How many leading tokens every sequence shares (at most ``limit``)."""
    first, n = sequences[0], limit
    for ids in sequences[1:]:
        i = 0
        while i < n and ids[i] == first[i]:
            i += 1
        n = i
    return n


def _shared_prefix_length(samples: Sequence[Sample]) -> int:
    # every sample keeps at least one suffix token
    n = _common_start([s.token_ids for s in samples], min(len(s.token_ids) for s in samples) - 1)
    # A sampled token must get its gradient from its own sequence's logits: stop before the first one.
    first_trained = min(s.trained.index(True) for s in samples)
    return max(0, min(n, first_trained))


def _collate(samples: list[Sample], prefix_len: int | list[int], pad_token_id: int) -> MicroBatch:
    """The samples' suffixes after ``prefix_len`` tokens (one for all, or one per sample), right-padded."""
    starts = prefix_len if isinstance(prefix_len, list) else [prefix_len] * len(samples)
    width = max(len(s.token_ids) - start for s, start in zip(samples, starts))
    b = len(samples)
    input_ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    trained = torch.zeros((b, width))
    advantages = torch.zeros((b, width))
    sampler = torch.full((b, width), math.nan)
    for i, (s, start) in enumerate(zip(samples, starts)):
        n = len(s.token_ids) - start
        input_ids[i, :n] = torch.tensor(s.token_ids[start:])
        attention[i, :n] = 1
        trained[i, :n] = torch.tensor(s.trained[start:], dtype=torch.float32)
        advantages[i, :n] = s.advantage
        sampler[i, :n] = torch.tensor(s.sampler_logprobs[start:])
    behaviour = None
    if any(s.behaviour_logprobs is not None for s in samples):  # off-policy data in this micro-batch
        behaviour = torch.full((b, width), math.nan)
        for i, (s, start) in enumerate(zip(samples, starts)):
            if s.behaviour_logprobs is not None:
                behaviour[i, : len(s.token_ids) - start] = torch.tensor(s.behaviour_logprobs[start:])
    return MicroBatch(input_ids, attention, trained, advantages, sampler, samples, behaviour)
