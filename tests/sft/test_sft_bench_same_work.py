"""The SFT benchmark (``tests/benchmarks/sft_vs_trl.py``) gives TRL exactly the work ours does.

TRL's assistant-only loss reads its mask from ``{% generation %}`` spans of the chat template. The benchmark
adds those markers to a copy of our template (``training_template``); these checks hold it to two promises,
without running either trainer: the marked template renders the same text, and Hugging Face's assistant mask
from it (what TRL trains on) is our trainer's mask (``trajectory_samples``), token for token, on the
benchmark's generated chats with tool calls.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from art_core.models import resolve_base_model
from art_core.training.samples import trajectory_samples
from art_core.types import Trajectory

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "sft_vs_trl.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("sft_vs_trl", BENCH)
    module = importlib.util.module_from_spec(spec)
    # The script imports its neighbour _same_work.py, as it does when run (its folder is then sys.path[0]).
    sys.path.insert(0, str(BENCH.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH.parent))
    return module


@pytest.fixture(scope="module")
def tokenizers(bench):
    folder = resolve_base_model("smollm2-135m-instruct")
    ours = AutoTokenizer.from_pretrained(folder)
    marked = AutoTokenizer.from_pretrained(folder)
    marked.chat_template = bench.training_template(ours.chat_template)
    return ours, marked


def test_chats_are_seeded_and_cover_every_shape(bench):
    chats = bench.make_chats(40)
    assert chats == bench.make_chats(40)
    assert chats != bench.make_chats(40, seed=1)
    calls_per_turn = {len(m["tool_calls"]) for c in chats for m in c["messages"] if m.get("tool_calls")}
    assistant_turns = {sum(m["role"] == "assistant" for m in c["messages"]) for c in chats}
    assert calls_per_turn == {1, 2}  # single and parallel calls
    assert assistant_turns == {1, 2, 3}  # a direct answer, one call then an answer, two calls in turn


def test_marked_template_renders_the_same_text(bench, tokenizers):
    ours, marked = tokenizers
    for chat in bench.make_chats(40):
        assert (marked.apply_chat_template(chat["messages"], tools=chat["tools"], tokenize=False)
                == ours.apply_chat_template(chat["messages"], tools=chat["tools"], tokenize=False))


def test_trl_mask_is_our_mask(bench, tokenizers):
    ours, marked = tokenizers
    for chat in bench.make_chats(40):
        [sample] = trajectory_samples(Trajectory(messages=chat["messages"], tools=chat["tools"]), ours,
                                      assistant_turns="all")
        # What TRL's SFTTrainer calls when assistant_only_loss=True (tools arrive as JSON text from its dataset)
        theirs = marked.apply_chat_template(chat["messages"], tools=json.loads(json.dumps(chat["tools"])),
                                            return_dict=True, return_assistant_tokens_mask=True)
        assert list(theirs["input_ids"]) == sample.token_ids
        assert [bool(m) for m in theirs["assistant_masks"]] == sample.trained
        # the mask is the assistant turns with their <|im_end|>, and nothing of the system prompt before them
        trained = ours.decode([t for t, m in zip(sample.token_ids, sample.trained) if m])
        assert trained.count("<|im_end|>") == sum(m["role"] == "assistant" for m in chat["messages"])
        assert "# Tools" not in trained and "<tool_response>" not in trained
