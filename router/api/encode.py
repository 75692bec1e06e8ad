"""A prompt's token ids, fast: the tokenizer's Rust backend called directly where it gives
the same ids, and the bound on characters per token that lets intake refuse a prompt too
long for the context before tokenizing it. Kept apart from :mod:`.intake` (which calls
them per request) because they depend only on the tokenizer."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)

# A token covers at most this many characters in the cheap bound applied before tokenizing
# (the tokenizer's longest vocabulary entry, when it can be read, replaces it).
DEFAULT_CHARS_PER_TOKEN = 32


def fast_encoder(tokenizer: Any, add_special_tokens: bool = True) -> Callable[[str], list[int]]:
    """A prompt's ids as ``tokenizer(text, add_special_tokens=...).input_ids`` gives them,
    from a fast tokenizer's Rust backend called directly when it gives the same ids (checked
    on probes here, once): no offsets computed, no ``BatchEncoding`` built, which is CPU the
    front door spends per request (BENCHMARKS.md, "Fronting vllm serve"). Otherwise the
    tokenizer itself."""
    special = add_special_tokens

    def slow(text: str) -> list[int]:
        if special:  # the tokenizer's default (a stand-in may take no keyword)
            return list(tokenizer(text).input_ids)
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not getattr(tokenizer, "is_fast", False) or backend is None:
        return slow
    batch = getattr(backend, "encode_batch_fast", None)  # tokenizers >= 0.21: no offsets

    def fast(text: str) -> list[int]:
        if batch is not None:
            return list(batch([text], add_special_tokens=special)[0].ids)
        return list(backend.encode(text, add_special_tokens=special).ids)

    specials = "".join(getattr(tokenizer, "all_special_tokens", None) or ())
    probes = ["", "Hello, world!", "  two  spaces\n\nand lines\t", "ünïcödé 你好 🙂", specials,
              f"{specials} text between {specials}"]  # fmt: skip
    try:
        if all(fast(p) == slow(p) for p in probes):
            return fast
    except Exception:  # an odd backend: the tokenizer's own call is the reference
        log.debug("tokenizer backend not used directly", exc_info=True)
    return slow


def chars_per_token(tokenizer: Any) -> int:
    """The most characters one token can stand for (its longest vocabulary entry)."""
    try:
        vocab = tokenizer.get_vocab()
        longest = max((len(t) for t in vocab), default=0)
    except Exception:  # a stand-in tokenizer in tests
        return DEFAULT_CHARS_PER_TOKEN
    return max(longest, 1)


def pieces_add_up(
    probes: Iterable[str],
    whole: Callable[[str], list[int]],
    pieces: Callable[[str], list[int] | None],
    cache: str,
) -> bool:
    """Whether every probe tokenized in ``pieces`` (twice: the second time from the cache
    the first filled) gives the ids of the probe tokenized ``whole``: the start-up check of
    a cache of pieces' ids (:mod:`.text_cache`, :mod:`.segment_cache`), which is off,
    logged as ``cache``'s, where it fails."""
    try:
        for text in probes:
            want = whole(text)
            if pieces(text) != want or pieces(text) != want:
                log.info("%s off: this tokenizer's pieces do not add up", cache)
                return False
    except Exception:
        log.info("%s off: the check failed", cache, exc_info=True)
        return False
    return True
