"""Sampling from the model being trained, in process, with transformers.

The engine shares the trainer's PEFT model object: after a training step the adapter it samples with is
already the new one, with no reload. It reports exactly what the trainer needs: prompt token ids,
completion token ids (up to and including the end-of-turn token) and the log-probability of each sampled
token under the model's own distribution (raw logits, before temperature or top-p), which is what the
trainer's forward pass computes, so truncated importance sampling compares like with like.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["Completion", "TransformersEngine"]


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    text: str


class TransformersEngine:
    """Batched sampling with ``model.generate``.

    Args:
        model: a causal LM (PEFT-wrapped or not).
        tokenizer: its tokenizer.
    """

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.stop_ids: set[int] = set(eos if isinstance(eos, list) else [eos])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.stop_ids))

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None) -> list[Completion]:
        """Sample one completion per prompt, all prompts in one batch.

        Args:
            prompts: token ids of each prompt (already rendered through the chat template).
            max_new_tokens: most tokens sampled per completion.
            temperature: 0 means greedy.
            top_p: nucleus sampling mass.
            seed: seeds torch's generator for this call.
        """
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        # Left padding: every prompt ends at the same position, where generation starts.
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            attention[i, width - len(p):] = 1
        if seed is not None:
            torch.manual_seed(seed)
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model.generate(
                input_ids=ids.to(device), attention_mask=attention.to(device), max_new_tokens=max_new_tokens,
                do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                top_p=top_p if temperature > 0 else None, top_k=None,
                eos_token_id=sorted(self.stop_ids), pad_token_id=self.pad_id,
                output_logits=True, return_dict_in_generate=True,
            )
        finally:
            self.model.train(was_training)
        new = out.sequences[:, width:]  # [N, T]
        logits = torch.stack(out.logits, dim=1).float()  # [N, T, V] raw, before temperature/top-p
        logprobs = (logits.gather(-1, new.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)).cpu()
        completions = []
        for i in range(len(prompts)):
            tokens = new[i].tolist()
            finish: Literal["stop", "length"] = "length"
            for j, tok in enumerate(tokens):
                if tok in self.stop_ids:
                    tokens, finish = tokens[: j + 1], "stop"
                    break
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            completions.append(Completion(tokens, logprobs[i, : len(tokens)].tolist(), finish, text))
        return completions
