"""``PromptEncoder``: cached stretches give exactly the tokenizer's ids, and it falls back where they might not."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from art_core.gateway.prompt_encoder import PromptEncoder


def _random_texts(specials: list[str], count: int, seed: int = 0) -> list[str]:
    """Texts that put added tokens against spaces, newlines, digits, accents, emoji and half-written tags."""
    rng = random.Random(seed)
    alphabet = [*"ab  \n\t.,!?1234567890xyzé🙂ü<>|_", "<|im", "end|>", "<tool_call>", "  ", "\n\n", "ĠĊ"]
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(0, 12)):
            if rng.random() < 0.3:
                parts.append(rng.choice(specials))
            else:
                parts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))))
        texts.append("".join(parts))
    return texts


def test_the_ids_are_the_tokenizers_on_random_texts_and_on_a_growing_conversation(tiny_model_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    encoder = PromptEncoder(tokenizer)
    assert encoder.segmented  # SmolLM2's byte-level BPE: stretches are encoded on their own
    specials = [t.content for t in tokenizer.backend_tokenizer.get_added_tokens_decoder().values()]
    for text in _random_texts(specials, 1500):
        expected = tokenizer.encode(text, add_special_tokens=False)
        assert encoder.encode(text) == expected, text  # a miss, encoded and cached
        assert encoder.encode(text) == expected, text  # a hit
    # A conversation that grows by one turn per call, as an agent's does: every earlier turn is a hit.
    messages = [{"role": "system", "content": "You call tools.\n\n  Be brief, ünïcödé 🙂."}]
    for turn in range(6):
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": f" turn {turn}\n<|im_end"})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False)


def test_the_cache_stays_within_its_bound(tiny_model_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    encoder = PromptEncoder(tokenizer, max_cached_chars=100)
    for i in range(50):
        text = f"<|im_start|>user\nmessage number {i} with some words<|im_end|>"
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    assert 0 < encoder._cached_chars <= 100


def _metaspace_tokenizer(prepend_scheme: str) -> PreTrainedTokenizerFast:
    """A small real tokenizer whose Metaspace pre-tokenizer marks only the text's first word when
    ``prepend_scheme="first"``: a stretch encoded alone would gain a marker it does not have in the text."""
    vocab = {"[UNK]": 0, "▁": 1, "▁a": 2, "a": 3, "▁b": 4, "b": 5, "<sep>": 6}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme)
    backend.add_special_tokens([AddedToken("<sep>", special=True, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.mark.parametrize(("scheme", "segmented"), [("first", False), ("always", True)])
def test_a_tokenizer_whose_stretches_depend_on_their_place_is_encoded_whole(scheme: str, segmented: bool):
    tokenizer = _metaspace_tokenizer(scheme)
    encoder = PromptEncoder(tokenizer)
    assert encoder.segmented is segmented
    for text in ("a b<sep>a b", "<sep>b a<sep>", "a<sep> b", ""):
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False)


def test_added_tokens_that_take_whitespace_turn_the_cache_off(tiny_model_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens([AddedToken("<tag>", lstrip=True, rstrip=True)])
    encoder = PromptEncoder(tokenizer)
    assert not encoder.segmented
    for text in ("a <tag> b", "x\n<tag>\ny", "<tag>"):
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False)
