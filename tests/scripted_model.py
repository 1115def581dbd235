"""A tiny real model taught to follow a script: it calls tools when a test's agent needs it to.

Adapter tests need a model that calls the right tool with the right arguments, then answers; the
embedded SmolLM2-135M rarely calls tools at all, and a random tiny model never does. So the tests fit a
tiny Qwen2 (a few million parameters, SmolLM2's tokenizer and tool template) to the exact conversations
they will run: for every assistant turn of a scripted conversation, the prompt is rendered exactly as the
gateway renders it (``art_core.gateway.tokens.render_prompt`` on ``art_core.messages.template_message``s) and the model
learns to emit that turn (``<tool_call>`` blocks or text, then ``<|im_end|>``) greedily.

The result is a real model on the real engine: real token ids and log-probabilities, real tool-call
parsing, real LoRA steps. Only its skill is scripted; that stands in for a capable model, which cannot
run on this machine fast enough. A prompt the script does not cover gets whatever the model makes of it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["Conversation", "call", "fit_scripted_model", "say", "tool_result"]

_FIT_VERSION = 2  # part of the cache key: bump it when fitting changes, so no stale fit is reused

Conversation = tuple[list[dict[str, Any]], list[dict[str, Any]]]
"""``(messages, tools)`` in chat-completions format; each assistant message is a turn the model learns."""


def call(name: str, **arguments: Any) -> dict[str, Any]:
    """A scripted assistant turn that calls ``name`` (ids are not rendered, so one id serves every call)."""
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}]}


def tool_result(content: str) -> dict[str, Any]:
    """The tool's answer to the scripted call."""
    return {"role": "tool", "tool_call_id": "call_1", "content": content}


def say(text: str) -> dict[str, Any]:
    """A scripted assistant turn of plain text."""
    return {"role": "assistant", "content": text}


def _turns(tokenizer: Any, conversation: Conversation) -> list[tuple[list[int], list[int]]]:
    from art_core.gateway.tokens import render_prompt
    from art_core.messages import template_message

    messages, tools = conversation
    rendered = [template_message(m) for m in messages]
    pairs = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render_prompt(tokenizer, rendered[:k], tools)
        full = tokenizer.apply_chat_template(rendered[: k + 1], tools=tools or None, tokenize=True,
                                             add_generation_prompt=False, return_dict=False)
        full = list(full["input_ids"] if isinstance(full, dict) else full)
        assert full[: len(prompt)] == prompt, "the template is not prefix-stable for this conversation"
        rest = full[len(prompt):]
        completion = rest[: rest.index(tokenizer.eos_token_id) + 1]
        pairs.append((prompt, completion))
    return pairs


def fit_scripted_model(base_dir: Path, conversations: Sequence[Conversation], out_root: Path | None = None, *,
                       hidden_size: int = 64, max_steps: int = 800) -> Path:
    """A tiny Qwen2 in ``out_root/scripted-<hash>`` that greedily reproduces every assistant turn of
    ``conversations``.

    ``base_dir`` supplies the tokenizer (with the tool chat template). Cached by content (the script, the
    fitting code's version, the tokenizer's folder, torch and transformers versions): the same script is
    fitted once per ``out_root``. The default ``out_root`` is art-core's model cache (``$ART_CACHE_DIR``,
    ``test-scripted-models/``), kept across clones like the converted base model, so a fresh clone's test
    run does not spend ~15 s per script fitting it again; ``build_once`` makes concurrent runs fit it once.
    """
    import torch
    import transformers

    from art_core.models import cache_dir
    from art_core.models._cache import build_once

    identity = [_FIT_VERSION, list(conversations), hidden_size, Path(base_dir).name, torch.__version__,
                transformers.__version__]
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    folder = (out_root or cache_dir() / "test-scripted-models") / f"scripted-{key}"
    return build_once(folder, lambda staging: _fit(base_dir, conversations, staging, hidden_size, max_steps),
                      info={"base": str(base_dir)})


def _fit(base_dir: Path, conversations: Sequence[Conversation], tmp: Path, hidden_size: int, max_steps: int) -> None:
    """Fit the model into the empty folder ``tmp``."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    base_tokenizer = AutoTokenizer.from_pretrained(base_dir)
    config = Qwen2Config(
        vocab_size=len(base_tokenizer), hidden_size=hidden_size, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=2 * hidden_size, tie_word_embeddings=True,
        max_position_embeddings=4096, bos_token_id=base_tokenizer.bos_token_id,
        eos_token_id=base_tokenizer.eos_token_id,
        pad_token_id=base_tokenizer.pad_token_id if base_tokenizer.pad_token_id is not None
        else base_tokenizer.eos_token_id,
    )
    # Render with the tokenizer exactly as the gateway will load it: from the model's folder, where the
    # model's config.json picks the tokenizer class (a Qwen2 config gives Qwen2Tokenizer, which splits
    # "\n\n" differently from the base model's own class).
    base_tokenizer.save_pretrained(tmp)
    config.save_pretrained(tmp)
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    pairs = [pair for conversation in conversations for pair in _turns(tokenizer, conversation)]
    threads = torch.get_num_threads()
    # One thread: many small ops, where a second thread mostly waits, and collapses when the machine is busy.
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(config)
            width = max(len(p) + len(c) for p, c in pairs)
            ids = torch.full((len(pairs), width), config.pad_token_id)
            labels = torch.full((len(pairs), width), -100)
            mask = torch.zeros((len(pairs), width), dtype=torch.long)
            for row, (prompt, completion) in enumerate(pairs):
                seq = prompt + completion
                ids[row, : len(seq)] = torch.tensor(seq)
                labels[row, len(prompt) : len(seq)] = torch.tensor(completion)
                mask[row, : len(seq)] = 1
            optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
            scored = labels[:, 1:] != -100
            targets = labels[:, 1:][scored]
            # Softmax over the tokens the script uses, not all 49k: 100x less work per step. Every other
            # token keeps its small random embedding, and the full-vocabulary check below makes sure of it.
            vocab = torch.unique(ids)
            local_targets = torch.searchsorted(vocab, targets)
            for step in range(max_steps):
                hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1][scored]
                logits = hidden @ model.lm_head.weight[vocab].T
                loss = torch.nn.functional.cross_entropy(logits, local_targets)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if step % 20 == 19 and _learned(model, ids, mask, scored, targets):
                    break
            else:
                raise AssertionError(f"the scripted model did not learn its {len(pairs)} turns in {max_steps} steps "
                                     f"(last loss {loss.item():.3f})")
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(tmp)


def _learned(model: Any, ids: Any, mask: Any, scored: Any, targets: Any) -> bool:
    """Whether every scripted token wins over the whole vocabulary by a clear margin (greedy is no coin toss)."""
    import torch

    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1][scored]
        top2 = model.lm_head(hidden).topk(2, dim=-1)
    return bool(((top2.indices[:, 0] == targets) & (top2.values[:, 0] - top2.values[:, 1] > 2.0)).all())
