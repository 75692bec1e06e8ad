"""A chat prompt's token ids, re-using the ids of the pieces of text seen before.

Why: a conversation's turn k+1 is its turn k plus a message or two, rendered through the
same chat template, and the front door tokenized all of it again, every turn: on a chat
load over cost-model replicas, the tokenizer was half the front door's busy CPU (issue 53,
item 6). vllm-router spends none on it (its cache-aware policy matches characters).

How, exactly: a fast tokenizer first cuts its input at its added tokens (the template's
role markers, ``<|im_start|>`` and the like) and tokenizes the text between them piece by
piece, each on its own. So the ids of a prompt are the ids of its pieces, in order, and a
piece's ids can be kept: the system prompt and every earlier message are pieces a later
turn repeats. This holds only for the tokenizers it holds for (a ``Metaspace`` that prepends
only at the very start of the input does not, nor an added token that strips the spaces
around it), so :class:`SegmentEncoder` checks it at start on probes, the model's own chat
template rendered included, and when any probe differs it never splits: every prompt is
tokenized whole, as before.

Only added tokens matched on the raw text with nothing stripped around them
(``normalized``, ``lstrip``, ``rstrip`` and ``single_word`` all false, as templates' markers
are) are cut at; any other stays inside its piece, where the tokenizer itself handles it.

Thread-safety: none; one per tokenizer thread (intake runs every tokenization on one).
Invariants: ``cached_chars`` is the sum of the lengths of the keys of ``_ids``, at most
``max_chars`` after each call; each cached value is the tokenizer's own ids of its key.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from .encode import fast_encoder, pieces_add_up

log = logging.getLogger(__name__)

# Text kept with its ids: a few thousand conversations' worth of pieces.
DEFAULT_MAX_CHARS = 16 << 20
# A piece shorter than this is tokenized each time: its lookup would cost about as much.
MIN_CACHED_CHARS = 16

_PROBE_TEXTS = (
    "Hello, world!",
    "  two  spaces\n\nand lines\t",
    " leading space",
    "\nleading newline",
    "12345 67.89",
    "ünïcödé 你好 🙂",
)


def _plain_added_tokens(backend: Any) -> dict[str, int]:
    """Added tokens the tokenizer cuts its input at before anything else touches it."""
    out: dict[str, int] = {}
    try:
        decoder = backend.get_added_tokens_decoder()
    except Exception:  # an older tokenizers, or a stand-in
        return out
    for token_id, tok in decoder.items():
        plain = not (
            getattr(tok, "normalized", True)
            or getattr(tok, "lstrip", False)
            or getattr(tok, "rstrip", False)
            or getattr(tok, "single_word", False)
        )
        if plain and tok.content:
            out[tok.content] = token_id
    return out


class SegmentEncoder:
    """``encode(text)``: the ids ``tokenizer(text, add_special_tokens=False)`` gives, the
    pieces between added tokens re-used from earlier calls where the tokenizer allows it
    (checked once, at construction; ``splits`` says whether it does)."""

    def __init__(self, tokenizer: Any, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self._ids: OrderedDict[str, list[int]] = OrderedDict()
        self.cached_chars = 0
        self.hits = 0
        self.misses = 0
        self._whole = fast_encoder(tokenizer, add_special_tokens=False)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._batch: Callable[[list[str]], list[list[int]]] | None = None
        self._added: dict[str, int] = {}
        self._cut: re.Pattern[str] | None = None
        if backend is not None and getattr(tokenizer, "is_fast", False):
            self._added = _plain_added_tokens(backend)
            fast = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
            self._batch = lambda texts: [e.ids for e in fast(texts, add_special_tokens=False)]
        if self._added:
            longest_first = sorted(self._added, key=len, reverse=True)
            self._cut = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")
        self.splits = self._cut is not None and pieces_add_up(
            self._probes(), self._whole, self._split, "segment cache"
        )
        if not self.splits:
            self._ids.clear()
            self.cached_chars = 0

    def _probes(self) -> list[str]:
        markers = list(self._added)[:8]
        texts = list(_PROBE_TEXTS)
        for m in markers:
            texts += [f"{m}{t}{m}" for t in _PROBE_TEXTS] + [f"a{m}{m} b {m}"]
        messages = [
            {"role": "system", "content": " You are terse.\n"},
            {"role": "user", "content": "Hi there 🙂, what is 12+30?"},
            {"role": "assistant", "content": "\n42."},
            {"role": "user", "content": "  And  ünïcödé?"},
        ]
        try:
            texts.append(
                self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False
                )
            )
        except Exception:  # no template: the plain probes decide
            log.debug("segment cache: no chat template to probe", exc_info=True)
        return texts

    def __call__(self, text: str) -> list[int]:
        if not self.splits:
            return self._whole(text)
        return self._split(text)

    def _split(self, text: str) -> list[int]:
        assert self._cut is not None and self._batch is not None
        parts = self._cut.split(text)  # text, marker, text, marker, ..., text
        ids_of: list[list[int] | None] = []
        missing: list[str] = []
        cache = self._ids
        for i, part in enumerate(parts):
            if i % 2:  # an added token
                ids_of.append([self._added[part]])
            elif not part:
                ids_of.append([])
            elif len(part) >= MIN_CACHED_CHARS and (got := cache.get(part)) is not None:
                cache.move_to_end(part)
                self.hits += 1
                ids_of.append(got)
            else:
                ids_of.append(None)
                missing.append(part)
        if missing:
            self.misses += len(missing)
            fresh = iter(self._batch(missing))
            for i, got in enumerate(ids_of):
                if got is None:
                    new = list(next(fresh))
                    ids_of[i] = new
                    self._keep(parts[i], new)
        out: list[int] = []
        for got in ids_of:
            out += got  # type: ignore[arg-type]
        return out

    def _keep(self, part: str, ids: Sequence[int]) -> None:
        if len(part) < MIN_CACHED_CHARS or len(part) > self.max_chars // 4:
            return
        if part not in self._ids:
            self.cached_chars += len(part)
        self._ids[part] = list(ids)
        while self.cached_chars > self.max_chars:
            old, _ = self._ids.popitem(last=False)
            self.cached_chars -= len(old)
