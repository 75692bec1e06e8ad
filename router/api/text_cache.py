"""A text prompt's token ids, re-using the ids of the stretches of text seen before.

Why: a completion's prompt is mostly a prefix many requests share (a system prompt, few-shot
examples, a document asked about again), and the front door tokenized all of it for every
request: about a third of its CPU per request in front of ``vllm serve``
(``benchmarks/router_http_cpu.py``; issue 53, item 6). vllm-router spends none on it.

How, exactly: a pre-tokenizer cuts its input into words, and the model tokenizes each word
on its own, so the ids of a text are the ids of its stretches, in order, when every cut
between two stretches is one the pre-tokenizer itself makes whatever comes around it. A
space between two ASCII letters is such a cut for the byte-level BPE tokenizers (GPT-2's
regex and the Llama-3 / Qwen ones: a run of letters ends at the space, and the space opens
the next word) and for Metaspace and whitespace pre-tokenizers. So a text is cut at the
first such space past every ``stretch_chars`` characters -- the same cuts wherever two
texts agree, since each depends only on the text before it and the letter after it -- and
each stretch's ids are kept: a shared prefix's stretches are tokenized once. What holds
for a tokenizer is checked at start, on probes cut at every such space, as
:mod:`.segment_cache` does for chats; a tokenizer with a normalizer, without a splitting
pre-tokenizer, with an added token that holds a space or strips what is around it, or
whose probes differ is never cut: every prompt is tokenized whole, as before.

Thread-safety: none; used from one thread at a time (intake: the tokenizer thread, or the
event loop while that thread is idle, :meth:`TextEncoder.cheap`).
Invariants: ``cached_chars`` is the sum of the lengths of the keys of ``_ids``, at most
``max_chars`` after each call; each cached value is the tokenizer's own ids of its key
(without special tokens).
"""

from __future__ import annotations

import json
import logging
import string
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .encode import fast_encoder, pieces_add_up

log = logging.getLogger(__name__)

# Text kept with its ids: ~9 MB of keys and ids per million characters (measured on
# smollm2-135m's tokenizer), so ~18 MB at most; ~500k tokens of distinct prefixes.
DEFAULT_MAX_CHARS = 2 << 20
# A stretch ends at the first cut past this many characters: a prompt shorter than two
# stretches is tokenized whole; the text after the last shared cut is tokenized each time.
DEFAULT_STRETCH_CHARS = 256

_LETTERS = frozenset(string.ascii_letters)
# Pre-tokenizers that cut at a space between letters whatever surrounds it (checked on
# probes besides); anything else, or none, leaves the text in one piece.
_SPLITTING = {
    "ByteLevel",
    "Split",
    "Metaspace",
    "Whitespace",
    "WhitespaceSplit",
    "BertPreTokenizer",
}
_PROBES = (
    "Hello world, this is a test of the cut.",
    "don't stop: it's fine, we'll see you're right they've gone I'm here he'd go",
    "  two  spaces\n\nand lines\t and tabs a\tb a\nb",
    "digits 12345 67.89 a1 b 2c x 3 y",
    "ünïcödé 你好 🙂 word é a é b ü c",
    "punct!? a-b a_b (a b) [x y] {c d} \"q r\" 'm n' a.b c",
    "The quick brown fox jumps over the lazy dog " * 3,
    "a b c d e f g h i j k l m n o p q r s t u v w x y z A B C Z",
)


def _splits(pre: dict[str, Any] | None) -> bool:
    """Whether the pre-tokenizer (its JSON) cuts its input into words at all."""
    if not pre:
        return False
    kind = pre.get("type")
    if kind == "Sequence":
        return any(_splits(p) for p in pre.get("pretokenizers", ()))
    if kind == "ByteLevel":
        return bool(pre.get("use_regex", True))
    if kind == "Metaspace":
        return bool(pre.get("split", True))
    return kind in _SPLITTING


class TextEncoder:
    """``encode(text)``: the ids ``tokenizer(text).input_ids`` gives, the stretches of
    ``text`` re-used from earlier calls where the tokenizer allows it (checked once, at
    construction; ``cuts`` says whether it does)."""

    def __init__(
        self,
        tokenizer: Any,
        max_chars: int = DEFAULT_MAX_CHARS,
        stretch_chars: int = DEFAULT_STRETCH_CHARS,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        self.stretch_chars = stretch_chars
        self._ids: OrderedDict[str, list[int]] = OrderedDict()
        self.cached_chars = 0
        self.hits = 0
        self.misses = 0
        self._whole = fast_encoder(tokenizer)
        self._head: list[int] = []  # special tokens the tokenizer puts around a text
        self._tail: list[int] = []
        self._bare: Callable[[str], list[int]] | None = None
        self.cuts = self._eligible() and pieces_add_up(
            _PROBES, self._whole, lambda text: self._cut(text, 1), "text cache"
        )
        self._ids.clear()  # the probes' stretches
        self.cached_chars = self.hits = self.misses = 0

    def _eligible(self) -> bool:
        """The tokenizer's shape allows cuts (the probes decide the rest)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or not getattr(self.tokenizer, "is_fast", False):
            return False
        try:
            pre = backend.pre_tokenizer
            spec = None if pre is None else json.loads(pre.__getstate__())
            decoder = backend.get_added_tokens_decoder()
        except Exception:  # a stand-in or an older tokenizers
            return False
        if backend.normalizer is not None or not _splits(spec):
            return False
        for tok in decoder.values():
            content = tok.content or ""
            stripping = tok.lstrip or tok.rstrip or tok.single_word
            if stripping or any(c.isspace() for c in content):
                return False
        bare = getattr(backend, "encode_batch_fast", None)
        if bare is not None:
            self._bare = lambda text: bare([text], add_special_tokens=False)[0].ids
        else:
            self._bare = lambda text: backend.encode(text, add_special_tokens=False).ids
        # The special tokens around a text: the same for every text (the probes check it).
        plain, marked = list(self._bare("Hello")), self._whole("Hello")
        for i in range(len(marked) - len(plain) + 1):
            if marked[i : i + len(plain)] == plain:
                self._head, self._tail = marked[:i], marked[i + len(plain) :]
                return True
        return False

    def __call__(self, text: str) -> list[int]:
        if not self.cuts or len(text) < 2 * self.stretch_chars:
            return self._whole(text)
        ids = self._cut(text, self.stretch_chars)
        assert ids is not None
        return ids

    def cheap(self, text: str, budget: int) -> list[int] | None:
        """The ids of ``text`` when at most ``budget`` of its characters are tokenized afresh
        (the stretches kept are free); None, with nothing tokenized, when more would be."""
        if not self.cuts or len(text) < 2 * self.stretch_chars:
            return self._whole(text) if len(text) <= budget else None
        return self._cut(text, self.stretch_chars, budget)

    def _stretches(self, text: str, every: int) -> list[str]:
        """``text`` cut at the first cut past every ``every`` characters."""
        out: list[str] = []
        start, end = 0, len(text)
        while start < end:
            cut = text.find(" ", start + every)
            while 0 < cut < end - 1 and not (
                text[cut - 1] in _LETTERS and text[cut + 1] in _LETTERS
            ):
                cut = text.find(" ", cut + 1)
            if cut < 0 or cut >= end - 1:
                cut = end
            out.append(text[start:cut])
            start = cut
        return out

    def _cut(self, text: str, every: int, budget: int | None = None) -> list[int] | None:
        assert self._bare is not None
        stretches = self._stretches(text, every)
        cache, bare = self._ids, self._bare
        kept = [cache.get(s) for s in stretches]
        if budget is not None:
            fresh = sum(len(s) for s, ids in zip(stretches, kept, strict=True) if ids is None)
            if fresh > budget:
                return None
        out = list(self._head)
        for stretch, got in zip(stretches, kept, strict=True):
            if got is not None:
                cache.move_to_end(stretch)
                self.hits += 1
            else:
                self.misses += 1
                got = list(bare(stretch))
                self._keep(stretch, got)
            out += got
        out += self._tail
        return out

    def _keep(self, stretch: str, ids: list[int]) -> None:
        if len(stretch) > self.max_chars // 4:
            return
        if stretch not in self._ids:  # a text may repeat a stretch: counted once
            self.cached_chars += len(stretch)
        self._ids[stretch] = ids
        while self.cached_chars > self.max_chars:
            old, _ = self._ids.popitem(last=False)
            self.cached_chars -= len(old)
