"""A text prompt's ids from cached stretches (router/api/text_cache.py) are the ids of the
whole text, for every tokenizer it cuts for, prompt after prompt; a tokenizer whose shape
does not allow the cuts (a normalizer, no pre-tokenizer, an added token with a space or one
that strips around it) is never cut."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.replica.model.models import tiny_model_path
from kvroute.router.api.text_cache import TextEncoder

from transformers import AutoTokenizer, PreTrainedTokenizerFast  # isort: skip
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers  # isort: skip
from tokenizers import pre_tokenizers, processors, trainers  # isort: skip

CORPUS = [
    "You are a helpful assistant. What is the capital of France? Paris, of course!",
    "  two  spaces\n\nand lines\t and tabs, digits 12345 67.89 and ünïcödé 你好 🙂",
    "don't stop: it's fine, we'll see -- they've gone (a b) [x y] \"q r\" a.b c_d",
] * 20


def _fast(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def byte_level(bos: bool = False, prefix_space: bool = False) -> PreTrainedTokenizerFast:
    """GPT-2 / SmolLM style (``bos``: a BOS put before every text, Llama-3 style)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<s>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    return _fast(tok)


def llama3_split() -> PreTrainedTokenizerFast:
    """Llama-3 / Qwen style: a Split regex, then ByteLevel without its own regex."""
    pattern = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
        r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    from tokenizers import Regex

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return _fast(tok)


def _trained(pre: Any, extra: list[AddedToken] | None = None, norm: Any = None) -> Any:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre
    if norm is not None:
        tok.normalizer = norm
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"]))
    if extra:
        tok.add_special_tokens(extra)
    return _fast(tok)


TOKENIZERS = {
    "tiny": lambda: AutoTokenizer.from_pretrained(tiny_model_path()),
    "byte-level": byte_level,
    "byte-level-bos": lambda: byte_level(bos=True),
    "byte-level-prefix-space": lambda: byte_level(prefix_space=True),
    "llama3-split": llama3_split,
    "metaspace-always": lambda: _trained(pre_tokenizers.Metaspace(prepend_scheme="always")),
    "metaspace-first": lambda: _trained(pre_tokenizers.Metaspace(prepend_scheme="first")),
    "whitespace": lambda: _trained(pre_tokenizers.Whitespace()),
}


def whole(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text).input_ids)


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return TOKENIZERS[request.param]()


def test_prompts_sharing_a_prefix_come_out_as_whole_and_reuse_its_stretches(
    tokenizer: Any,
) -> None:
    enc = TextEncoder(tokenizer, stretch_chars=32)
    rng = random.Random(3)
    words = [w for line in CORPUS[:3] for w in line.split(" ")]
    prefix = " ".join(rng.choice(words) for _ in range(120))
    for i in range(5):
        text = prefix + " " + " ".join(rng.choice(words) for _ in range(10)) + f" {i}"
        assert enc(text) == whole(tokenizer, text), i
    if enc.cuts:
        assert enc.hits >= 4 * 10  # the prefix's stretches, from the second prompt on


def test_which_tokenizers_are_cut() -> None:
    assert TextEncoder(byte_level()).cuts
    assert TextEncoder(byte_level(bos=True)).cuts
    assert TextEncoder(llama3_split()).cuts
    lower = _trained(pre_tokenizers.Whitespace(), norm=normalizers.Lowercase())
    assert not TextEncoder(lower).cuts  # a normalizer: not reasoned about, never cut
    spaced = _trained(pre_tokenizers.Whitespace(), [AddedToken("a b", special=True)])
    assert not TextEncoder(spaced).cuts  # an added token a cut could fall in
    strip = _trained(pre_tokenizers.Whitespace(), [AddedToken("<m>", rstrip=True, special=True)])
    assert not TextEncoder(strip).cuts  # it eats the space a cut would leave to the next


def test_a_short_prompt_is_tokenized_whole() -> None:
    enc = TextEncoder(byte_level())
    assert enc("Hello world") == whole(enc.tokenizer, "Hello world")
    assert enc.hits == enc.misses == 0


PIECES = st.sampled_from(
    [" ", "  ", "\n", "\t", "a", "Paris", " of", " b", "x ", "'s", "'t", " don", "12", "3.5",
     "ü", "你好", "🙂", "<|im_start|>", "<s>", "▁", "\"a\": [1]", "-", "_", "é"]
)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(st.lists(PIECES, max_size=40), st.integers(0, 2))
def test_any_text_comes_out_as_whole(pieces: list[str], repeat: int) -> None:
    for name in TOKENIZERS:
        if name not in _ENCODERS:
            _ENCODERS[name] = TextEncoder(TOKENIZERS[name](), stretch_chars=1)
        enc = _ENCODERS[name]
        text = "".join(pieces) * (repeat + 1)
        assert not enc.cuts or enc._cut(text, 1) == whole(enc.tokenizer, text), (name, text)
        assert enc(text) == whole(enc.tokenizer, text), (name, text)
        assert enc(text) == whole(enc.tokenizer, text), (name, text)  # from the cache


_ENCODERS: dict[str, TextEncoder] = {}


def test_the_cache_stays_within_its_bound() -> None:
    enc = TextEncoder(byte_level(), max_chars=4000, stretch_chars=16)
    for i in range(50):
        enc(f"{'word ' * 40}and {i} more words here {'tail ' * i}")
    assert enc.cached_chars <= 4000
    assert enc.cached_chars == sum(len(k) for k in enc._ids)


def test_cheap_tokenizes_only_within_its_budget() -> None:
    """What is known is free; past the budget nothing is tokenized (None), and the ids
    that come back are the whole text's."""
    enc = TextEncoder(byte_level(), stretch_chars=16)
    prefix = "word " * 40
    text = prefix + "and one more tail here"
    assert enc.cheap(text, 50) is None and enc.misses == 0
    assert enc(prefix + "x") == whole(enc.tokenizer, prefix + "x")
    assert enc.cheap(text, 50) == whole(enc.tokenizer, text)  # only the tail was fresh
    assert enc.cheap("short text", 5) is None
    assert enc.cheap("short text", 50) == whole(enc.tokenizer, "short text")
