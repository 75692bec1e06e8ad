"""Incremental detokenization with stop strings, for streaming.

Why hold text back: a multi-byte character split across tokens decodes to U+FFFD until its
last byte arrives, and the first characters of a stop string must not reach a client that
the stop string's match would then cut. So only text that can no longer change is emitted.

Why ``tokenizers``' ``DecodeStream`` where it applies (a fast tokenizer whose Python wrapper
adds nothing to the Rust decode): it keeps the context window and the incomplete bytes on
the Rust side, one call per token, against two decodes of a window per token crossing
from Python each time (the fallback, which any tokenizer takes, and which also decodes a finished
request's incomplete tail, which the stream holds back for good, and the rest of a request
whose bytes the stream refuses: a byte-fallback tokenizer's bytes that never form UTF-8).
This runs on the replica's engine thread, per token of every sequence, between GPU steps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

try:
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # tokenizers < 0.21: the window decode alone
    _DecodeStream = None

_REPLACEMENT = "\ufffd"
# Re-decoding a few tokens before the new ones keeps merges (spaces, byte pieces) exact
# without decoding the whole output every step.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into stable text deltas."""

    def __init__(
        self,
        tokenizer: Any,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        *,
        stream: bool = True,
    ) -> None:
        """``stream=False``: the window decode even where ``DecodeStream`` applies (their
        text must agree, though the stream may hand it out in other pieces; tests compare
        them)."""
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all decoded text (cut at a stop string once one matched)
        self.sent = 0  # characters of ``text`` already handed out
        self._ids: list[int] = []
        self._prefix_offset = 0  # tokens before this start the context window
        self._read_offset = 0  # tokens before this are in ``self.text`` for good
        self.stop_string: str | None = None
        rust = _rust_decode(tokenizer)
        # Bound once: called twice per token, where a method and its keyword cost more.
        self._decode: Callable[[Sequence[int]], str] = functools.partial(
            rust or tokenizer.decode, skip_special_tokens=skip_special_tokens
        )
        self._stream: Any = None
        if stream and rust is not None and _DecodeStream is not None:
            self._stream = _DecodeStream(skip_special_tokens=skip_special_tokens)
            self._stream_step = functools.partial(self._stream.step, tokenizer._tokenizer)

    @property
    def incremental(self) -> bool:
        """Whether text comes from the tokenizer's incremental decode stream (a fast
        tokenizer with it) rather than re-decoding a window of tokens per update."""
        return self._stream is not None

    def update(self, new_token_ids: Sequence[int], finished: bool = False) -> str:
        """Adds tokens; returns the text that became final. Sets ``stop_string`` on a match."""
        if self.stop_string is not None:
            return ""
        text = self.text
        new = (
            self._stream_text(new_token_ids, finished)
            if self._stream is not None
            else self._window_text(new_token_ids, finished)
        )
        if new:
            self.text = text + new
            if self.stop:
                self._match_stop(max(len(text) - self._hold, 0))
            text = self.text
        ready = len(text) if (finished or self.stop_string) else len(text) - self._hold
        if ready <= self.sent:
            return ""
        delta = text[self.sent : ready]
        self.sent = ready
        return delta

    def _window_text(self, new_token_ids: Sequence[int], finished: bool) -> str:
        """The new final text, by decoding a window of recent tokens with and without the
        new ones."""
        ids, start = self._ids, self._prefix_offset
        ids.extend(new_token_ids)
        prefix = self._decode(ids[start : self._read_offset])
        full = self._decode(ids[start:])
        # An incomplete character at the end waits for its next byte.
        if finished or not full.endswith(_REPLACEMENT):
            self._prefix_offset = max(len(ids) - _CONTEXT_TOKENS, 0)
            self._read_offset = len(ids)
            return full[len(prefix) :]
        return ""

    def _stream_text(self, new_token_ids: Sequence[int], finished: bool) -> str:
        """The new final text, from the Rust decode stream; ``_read_offset`` counts the
        tokens it has turned into text."""
        ids, step = self._ids, self._stream_step
        pieces = []
        for k, token_id in enumerate(new_token_ids):
            ids.append(token_id)
            try:
                piece = step(token_id)
            except Exception:  # bytes that can never become UTF-8 (a byte-fallback
                # tokenizer's): the window decode renders them as U+FFFD, as a whole
                # decode does, for the rest of this request
                self._stream = None
                self._prefix_offset = max(self._read_offset - _CONTEXT_TOKENS, 0)
                pieces.append(self._window_text(new_token_ids[k + 1 :], finished))
                return "".join(pieces)
            if piece is not None:  # None: a character still incomplete
                pieces.append(piece)
                self._read_offset = len(ids)
        if finished and self._read_offset < len(ids):  # an incomplete tail, rendered as is
            self._prefix_offset = max(self._read_offset - _CONTEXT_TOKENS, 0)
            pieces.append(self._window_text((), finished=True))
        return "".join(pieces)

    def resume(self, token_ids: Sequence[int], sent_chars: int) -> None:
        """Continues a request whose first ``token_ids`` were generated elsewhere, of whose
        text ``sent_chars`` characters were already handed out: the same text is rebuilt
        (and held back) by the same steps, one token at a time, as generation made it --
        decoding them at once could render a broken byte sequence differently."""
        for token_id in token_ids:
            self.update([token_id])
        self.sent = min(max(sent_chars, 0), len(self.text))

    def _match_stop(self, start: int) -> None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.text = self.text[: best[0]]
            self.stop_string = best[1]

    def flush(self) -> str:
        """The held-back tail, once the request has finished for another reason."""
        if self.sent >= len(self.text):
            return ""
        delta = self.text[self.sent :]
        self.sent = len(self.text)
        return delta


def _rust_decode(tokenizer: Any) -> Any:
    """The Rust ``tokenizers`` decode behind a transformers fast tokenizer, when calling it
    directly gives the same text (no clean-up of tokenization spaces): it skips the Python
    wrapper's argument conversion, which costs more than the decode itself."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - transformers depends on it
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(
        tokenizer, "clean_up_tokenization_spaces", True
    ):
        return None
    return backend.decode
