"""Rendered prompts to token ids, each stretch of text between two special tokens encoded once.

A Hugging Face tokenizer first cuts the text at its added tokens (``<|im_start|>``, ``<|im_end|>``...) and
then encodes each stretch between them on its own: normalizer, pre-tokenizer and model never see across a
cut. A chat prompt is mostly such stretches that came before: the system prompt and tool schemas of every
call, and each earlier message of a growing conversation. ``PromptEncoder`` cuts the text where the
tokenizer would, and takes each stretch's ids from a bounded cache, encoding only the ones it has not seen.
The ids are the tokenizer's own, exactly; where the tokenizer is not known to encode stretches
independently, every prompt is encoded whole (see ``PromptEncoder.segmented``).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from typing import Any

__all__ = ["PromptEncoder"]

logger = logging.getLogger(__name__)

# Pre-tokenizers that work on each stretch alone, whatever comes before it. Metaspace is one only when it
# prepends its marker to every stretch or to none ("first" looks at where the stretch sits in the text).
_INDEPENDENT_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit",
                               "BertPreTokenizer", "UnicodeScripts", "CharDelimiterSplit"}
_MODELS = {"BPE", "WordPiece", "WordLevel", "Unigram"}


class PromptEncoder:
    """``tokenizer.encode(text, add_special_tokens=False)``, with the stretches between added tokens cached.

    Args:
        tokenizer: a Hugging Face tokenizer; one without a Rust backend is encoded whole every time.
        max_cached_chars: characters of text whose ids are kept (least recently used dropped first).
            Default: 2 million, about 20 MB of ids.
    """

    def __init__(self, tokenizer: Any, *, max_cached_chars: int = 2_000_000) -> None:
        self.tokenizer = tokenizer
        self.max_cached_chars = max_cached_chars
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()  # the gateway runs in one loop, but art-core serve may share a tokenizer
        self._cuts: re.Pattern[str] | None = None
        self._added_ids: dict[str, int] = {}
        plan = _plan(self._backend)
        if plan is not None:
            self._cuts, self._added_ids = plan
            if not self._agrees_on_probe():
                logger.warning("the tokenizer encodes text differently in stretches than whole; prompts are encoded "
                               "whole (slower, same ids)")
                self._cuts = None

    @property
    def segmented(self) -> bool:
        """Whether stretches are cached (False: every prompt is encoded whole)."""
        return self._cuts is not None

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, as the tokenizer's ``encode(text, add_special_tokens=False)`` gives them."""
        if self._cuts is None:
            return self._whole(text)
        ids: list[int] = []
        start = 0
        for match in self._cuts.finditer(text):
            if match.start() > start:
                ids += self._stretch(text[start:match.start()])
            ids.append(self._added_ids[match.group()])
            start = match.end()
        if start < len(text):
            ids += self._stretch(text[start:])
        return ids

    def _stretch(self, text: str) -> list[int]:
        with self._lock:
            ids = self._cache.get(text)
            if ids is not None:
                self._cache.move_to_end(text)
                return ids
        ids = self._whole(text)
        if len(text) <= self.max_cached_chars:
            with self._lock:
                if text not in self._cache:
                    self._cache[text] = ids
                    self._cached_chars += len(text)
                    while self._cached_chars > self.max_cached_chars:
                        dropped, _ = self._cache.popitem(last=False)
                        self._cached_chars -= len(dropped)
        return ids

    def _whole(self, text: str) -> list[int]:
        if self._backend is not None:
            # The Rust tokenizer directly: same ids as tokenizer.encode, without transformers' Python wrapper.
            ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
            return ids
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def _agrees_on_probe(self) -> bool:
        """Stretch by stretch equals whole on a text that puts added tokens against text and spaces."""
        tokens = list(self._added_ids)[:4]
        probe = " Hello\n".join(tokens) + "  world 12 <|x|>\n" + "\n\n".join(tokens[::-1]) + " end"
        expected = self._whole(probe)
        got = self.encode(probe)
        with self._lock:
            self._cache.clear()
            self._cached_chars = 0
        return got == expected


def _plan(backend: Any) -> tuple[re.Pattern[str], dict[str, int]] | None:
    """The pattern that cuts text at the added tokens as the tokenizer does, and each token's id; None when
    the tokenizer's stretches are not known to be encoded independently (then prompts are encoded whole)."""
    if backend is None or getattr(backend, "encode_special_tokens", False):
        return None  # no Rust tokenizer, or special tokens are encoded as text: cut nowhere
    try:
        config = json.loads(backend.to_str())
        added = backend.get_added_tokens_decoder()
    except Exception:  # an unusual backend: stay with whole-text encoding
        return None
    model = config.get("model") or {}
    if model.get("type") not in _MODELS or model.get("dropout") not in (None, 0, 0.0):
        return None  # BPE dropout samples a different split each time: nothing to cache
    if not _independent(config.get("pre_tokenizer")):
        return None
    tokens = list(added.values())
    if not tokens:
        return None
    if any(t.lstrip or t.rstrip or t.single_word for t in tokens):
        return None  # such tokens take or look at the whitespace beside them: the cut is not a plain split
    if config.get("normalizer") is not None and any(t.normalized for t in tokens):
        return None  # matched in normalized text, a second pass: not reproduced here
    ids = {t.content: i for i, t in added.items()}
    # The tokenizer matches leftmost-longest; a regex alternation tries its branches in order at each
    # position, so longest first gives the same matches.
    pattern = re.compile("|".join(re.escape(c) for c in sorted(ids, key=len, reverse=True)))
    return pattern, ids


def _independent(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_independent(p) for p in pre_tokenizer.get("pretokenizers", []))
    if kind == "Metaspace":
        return pre_tokenizer.get("prepend_scheme") in ("always", "never")
    return kind in _INDEPENDENT_PRE_TOKENIZERS
