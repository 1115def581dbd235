"""Constrained decoding for ``SamplingParams.json_schema``: a token mask per step, from llguidance.

Why llguidance (``pip install art-core[structured]``): it is maintained (Microsoft's guidance team; vLLM,
SGLang and llama.cpp use it as a structured-output backend), it is a ~8 MB Rust wheel with no torch or
triton dependency (xgrammar pulls in triton, ~1 GB, for GPU kernels we do not use on CPU; outlines and
lm-format-enforcer walk the vocabulary in Python and are slower per step), it compiles a schema lazily
(milliseconds, no per-schema vocabulary scan up front), and it covers most of JSON Schema: ``$ref``,
``anyOf``, ``enum``, string ``pattern`` / ``maxLength``, number bounds, array ``maxItems``...

One ``JsonSchemaGuide`` per engine holds the llguidance view of the tokenizer (built once, ~1 s) and the
compiled grammars (cached by schema). Each decoded row gets its own ``LLMatcher``; per step the engine
asks it for the allowed tokens (``allowed_tokens``), samples among them, and feeds the sampled token back
(``advance``). End-of-turn tokens are allowed exactly when the JSON value is complete, so a constrained
row stops on its own with schema-valid text (unless ``max_tokens`` cuts it first).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from typing import Any

import torch

from ..errors import ConstraintError, EngineError

__all__ = ["JsonSchemaGuide", "allowed_tokens", "advance"]

INSTALL_HINT = "pip install 'art-core[structured]' (it installs llguidance)"

# Fixed separators, as Python's json.dumps writes them: a model cannot spend its token budget on
# whitespace (small models under a flexible-whitespace grammar happily emit newlines forever).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_BITS = torch.arange(32, dtype=torch.int32)  # [32]: bit positions inside one int32 mask word


class JsonSchemaGuide:
    """Compiles JSON schemas into llguidance matchers for one tokenizer.

    Args:
        tokenizer: the engine's Hugging Face tokenizer (a fast one: llguidance reads its ``tokenizer.json``).
        vocab_size: width of the model's logits (may exceed the tokenizer's vocabulary; extra ids are
            never allowed under a schema).
        stop_ids: end-of-turn token ids, allowed once the JSON value is complete.

    Raises:
        EngineError: llguidance is not installed (the message says how to install it).
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int, stop_ids: Iterable[int]) -> None:
        try:
            import llguidance  # noqa: F401  # only to fail early, with the install hint
        except ImportError as exc:
            raise EngineError(
                f"a request asked for JSON-schema output, which needs llguidance: {INSTALL_HINT}") from exc
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self._ll_tokenizer: Any = None
        self._grammars: dict[str, str] = {}
        self._lock = threading.Lock()  # the event loop (checks) and the decode thread (matchers) both compile

    def check(self, schema: dict[str, Any] | None = None, *, grammar: str | None = None) -> None:
        """Compile ``schema`` (or the Lark ``grammar``) now, so one llguidance cannot follow fails its own
        request only.

        Raises:
            ConstraintError: llguidance cannot constrain output to it (the message says why).
        """
        self._grammar(schema, grammar)

    def matcher(self, schema: dict[str, Any] | None = None, *, grammar: str | None = None) -> Any:
        """A fresh ``llguidance.LLMatcher`` for one row, at the start of the JSON value (or grammar)."""
        import llguidance

        compiled = self._grammar(schema, grammar)
        matcher = llguidance.LLMatcher(self._tokenizer(), compiled, log_level=0)  # errors are read, not logged
        if matcher.is_error():
            raise ConstraintError(f"cannot constrain output to this {_what(grammar)}: {matcher.get_error()}")
        return matcher

    def _grammar(self, schema: dict[str, Any] | None, grammar: str | None) -> str:
        import llguidance

        if (schema is None) == (grammar is None):
            raise EngineError("constrain output to a JSON schema or a grammar: give exactly one")
        key = json.dumps(schema, sort_keys=True) if grammar is None else "lark:" + grammar
        with self._lock:
            if key not in self._grammars:
                what = _what(grammar)
                try:
                    if grammar is not None:
                        compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
                    else:
                        compiled = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
                except (ValueError, TypeError) as exc:
                    raise ConstraintError(f"cannot constrain output to this {what}: {exc}") from exc
                problem = llguidance.LLMatcher.validate_grammar(compiled, self._tokenizer_locked())
                if problem and not problem.startswith("WARNING"):
                    raise ConstraintError(f"cannot constrain output to this {what}: {problem}; "
                                          f"it starts: {key[:200]}")
                self._grammars[key] = compiled
            return self._grammars[key]

    def _tokenizer(self) -> Any:
        with self._lock:
            return self._tokenizer_locked()

    def _tokenizer_locked(self) -> Any:
        if self._ll_tokenizer is None:
            import llguidance.hf

            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=self.stop_ids)
            except ValueError as exc:  # a slow (Python) tokenizer: llguidance needs tokenizer.json
                raise EngineError(f"JSON-schema output needs a fast Hugging Face tokenizer: {exc}") from exc
        return self._ll_tokenizer


def _what(grammar: str | None) -> str:
    return "JSON schema" if grammar is None else "grammar"


def allowed_tokens(matcher: Any, vocab_size: int) -> torch.Tensor:
    """The tokens the schema allows next, as a ``[vocab_size]`` bool mask.

    Raises:
        EngineError: the matcher is in an error state (it then allows nothing).
    """
    if matcher.is_error():
        raise EngineError(f"constrained decoding failed: {matcher.get_error()}")
    words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)  # [ceil(V'/32)]
    bits = (words[:, None] >> _BITS) & 1  # [W, 32]: bit b of word w allows token 32*w + b
    mask = bits.flatten().bool()  # [32*W]
    if mask.numel() >= vocab_size:
        return mask[:vocab_size]
    return torch.cat([mask, torch.zeros(vocab_size - mask.numel(), dtype=torch.bool)])


def advance(matcher: Any, token: int) -> None:
    """Feed the sampled ``token`` to the row's matcher.

    Raises:
        EngineError: the matcher refused the token (it was sampled from outside the mask: a bug here).
    """
    if not matcher.consume_token(token):
        raise EngineError(f"constrained decoding refused token {token}: {matcher.get_error()}")
