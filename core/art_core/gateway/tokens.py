"""Between chat messages and token ids: render the prompt, decode completions, describe single tokens.

The gateway renders prompts itself (the engine sees only ids) with the tokenizer's own chat template, so
the ids it records are exactly the ids the engine ran.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from ..messages import template_messages
from .chat_template import ChatTemplate
from .errors import APIError
from .prompt_encoder import PromptEncoder

__all__ = ["Detokenizer", "TextStream", "completion_room", "model_context", "render_prompt"]

logger = logging.getLogger(__name__)

# Tool-call markup some tokenizers register as special tokens (Hermes 3, Llama 3.1): decoding must keep
# them, or the tool-call parser would never see the calls.
_KEEP_SPECIAL = ("<tool_call>", "</tool_call>", "<|python_tag|>")


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
                  encoder: PromptEncoder | None = None, template: ChatTemplate | None = None) -> list[int]:
    """Prompt token ids: the conversation through the chat template, ending with the assistant's header.

    ``messages`` are OpenAI chat messages; ``art_core.messages.template_messages`` converts them first.
    ``encoder`` (the gateway's, built on ``tokenizer``) reuses the ids of text seen in earlier prompts;
    without it the text is encoded whole. ``template`` (the gateway's, built on ``tokenizer``) renders with
    the per-tokenizer work done once; without it ``apply_chat_template`` renders. The ids are the same
    either way.

    Raises:
        APIError: 422 when the template refuses the conversation (e.g. an image part for a text model);
            400 when the prompt does not fit the model's context.
    """
    try:
        # Render to text, then encode: what apply_chat_template(tokenize=True) does (add_special_tokens=False),
        # without the ~0.2 ms its general __call__ path (padding, truncation, BatchEncoding) adds per request.
        converted = template_messages(messages)
        text = (template.render(converted, tools or None) if template is not None else
                tokenizer.apply_chat_template(converted, tools=tools or None, add_generation_prompt=True,
                                              tokenize=False))
    except Exception as exc:  # jinja's TemplateError, raise_exception(), or a template tripping on odd input
        logger.info("chat template refused a request: %s: %s", type(exc).__name__, exc)
        raise APIError(
            422, f"this model's chat template cannot render the conversation: {exc}", param="messages",
            code="unsupported_content",
        ) from exc
    ids = encoder.encode(text) if encoder is not None else encode_text(tokenizer, text)
    context = model_context(tokenizer)
    if context is not None and len(ids) >= context:
        raise APIError(
            400, f"the prompt has {len(ids)} tokens but the model's context is {context}: shorten the conversation",
            param="messages", code="context_length_exceeded",
        )
    return ids


def model_context(tokenizer: Any) -> int | None:
    """The model's context length in tokens (``model_max_length``); None when the tokenizer does not set it."""
    context = getattr(tokenizer, "model_max_length", None)
    return context if isinstance(context, int) and context < 10**8 else None  # huge values mean "not set"


def completion_room(tokenizer: Any, prompt_tokens: int, max_tokens: int, param: str | None) -> int:
    """The completion length a call gets: ``max_tokens`` when prompt and completion fit the context; else, for a
    length the request did not set (``param`` None: the gateway's default), what is left of the context.

    Raises:
        APIError: 400 ``context_length_exceeded`` when the request's own ``param`` asks for more than fits (as
            OpenAI and vLLM answer: a completion past the context would be sampled at positions the model was
            never trained on, and recorded for training).
    """
    context = model_context(tokenizer)
    if context is None or prompt_tokens + max_tokens <= context:
        return max_tokens
    room = context - prompt_tokens  # >= 1: render_prompt refuses a prompt that fills the context
    if param is None:
        return room
    raise APIError(
        400, f"this request needs {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} "
        f"in the completion) but the model's context is {context}: set {param} to at most {room}, or shorten the "
        "conversation", param=param, code="context_length_exceeded",
    )


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=False)``, through the Rust tokenizer when there is one.

    Same ids (the Rust tokenizer does the work either way); skipping transformers' Python wrapper saves
    about 0.1 ms a request on the gateway's hot path.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]


class Detokenizer:
    """Decodes completion ids the way the client sees them: special tokens dropped, tool-call tags kept.

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", {})  # id -> AddedToken (17 entries, not the 49k vocab)
        special = {i for i, token in added.items() if getattr(token, "special", False)} | set(tokenizer.all_special_ids)
        keep = {i for i, token in added.items() if str(token) in _KEEP_SPECIAL}
        self.skip_ids: frozenset[int] = frozenset(special - keep)
        """Ids left out of text: end-of-turn, padding and the other control tokens."""
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        # Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) spells each byte as one printable character, so a
        # token's exact bytes can be read off its string even when it holds half a UTF-8 character.
        self._byte_level = "ByteLevel" in repr(decoder)
        self._byte_decoder = {char: byte for byte, char in _bytes_to_unicode().items()}

    def visible(self, ids: list[int]) -> list[int]:
        """``ids`` without the special tokens that are not part of the text."""
        return [i for i in ids if i not in self.skip_ids]

    def decode(self, ids: list[int]) -> str:
        """The completion's text, as the client receives it (before tool-call parsing)."""
        return self.tokenizer.decode(self.visible(ids), skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one token (OpenAI's ``bytes`` field in logprobs)."""
        if self._byte_level:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in self._byte_decoder for c in piece):
                return bytes(self._byte_decoder[c] for c in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """One token as text; a partial UTF-8 character shows as U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def text_pieces(self, ids: list[int], text: str) -> Iterator[tuple[str, int]]:
        """Pieces of ``text`` as the tokens produce it, each with how many visible tokens it took.

        The pieces always join to exactly ``text`` (the decoded, possibly stop-string-cut completion) and
        their counts add up to ``len(self.visible(ids))``: when decoding piece by piece stops agreeing with
        ``text``, the rest is sent as one piece.
        """
        ids = self.visible(ids)
        sent = 0
        # Decode a short window rather than the whole prefix each time (linear, not quadratic), and hold
        # a token back while it ends in half a character (U+FFFD).
        prefix, read = 0, 0
        for end in range(1, len(ids) + 1):
            before = self.tokenizer.decode(ids[prefix:read], skip_special_tokens=False)
            after = self.tokenizer.decode(ids[prefix:end], skip_special_tokens=False)
            if len(after) <= len(before) or after.endswith("\ufffd"):
                continue
            piece = after[len(before) :]
            if not text.startswith(piece, sent):
                break
            sent += len(piece)
            yield piece, end - read
            prefix, read = read, end
        if sent < len(text) or read < len(ids):
            yield text[sent:], len(ids) - read


class TextStream:
    """A completion's text as its tokens arrive: pieces safe to send now, never taken back.

    A token is held while it ends in half a UTF-8 character, and text is held while it may be the start
    of a stop string (the stop string itself is never sent, as in OpenAI's API). ``final`` is the whole
    completion's text, decoded at once and cut at the first stop string: what the record and the parsed
    reply hold. Pieces add up to a prefix of it (decoding a window agrees with decoding the whole for
    byte-level BPE); ``rest`` sends what is left.

    Args:
        detokenizer: the gateway's ``Detokenizer``.
        stop: the request's stop strings.
    """

    def __init__(self, detokenizer: Detokenizer, stop: tuple[str, ...]) -> None:
        self._detokenizer = detokenizer
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []  # visible ids so far
        self._prefix = self._read = 0  # window of ids decoded for the next piece, as in text_pieces
        self._text = ""  # decoded so far (may run past a stop string)
        self._sent = 0  # characters of _text handed out
        self.stopped = False
        """A stop string has appeared: nothing after it goes out."""

    def feed(self, ids: list[int]) -> str:
        """Take newly sampled ids; return the text that can go out now (often one token's, or '')."""
        visible = self._detokenizer.visible(ids)
        if not visible or self.stopped:
            return ""
        self._ids += visible
        decode = self._detokenizer.tokenizer.decode
        before = decode(self._ids[self._prefix : self._read], skip_special_tokens=False)
        after = decode(self._ids[self._prefix :], skip_special_tokens=False)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._text += after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        cuts = [self._text.find(s) for s in self._stop if s in self._text]
        if cuts:
            self.stopped = True
            safe = min(cuts)
        else:
            safe = len(self._text) - self._hold
        if safe <= self._sent:
            return ""
        piece, self._sent = self._text[self._sent : safe], safe
        return piece

    def final(self, all_ids: list[int]) -> str:
        """The whole completion's text (decoded at once, cut at the first stop string)."""
        text = self._detokenizer.decode(all_ids)
        cuts = [text.find(s) for s in self._stop if s in text]
        return text[: min(cuts)] if cuts else text

    def rest(self, final: str) -> str:
        """What is left to send of ``final`` after the pieces already sent."""
        sent = self._text[: self._sent]
        if not final.startswith(sent):  # never expected for byte-level BPE; the pieces cannot be taken back
            logger.error("streamed text pieces are not a prefix of the decoded completion")
            return ""
        return final[len(sent) :]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))
