"""The chat prompt's ids from cached pieces (router/api/segment_cache.py) are the ids of the
whole text, for every tokenizer it splits for, turn after turn; a tokenizer whose pieces do
not add up (a Metaspace that prepends at the very start only) is never split."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.replica.model.models import tiny_model_path
from kvroute.router.api.segment_cache import SegmentEncoder

from transformers import AutoTokenizer, PreTrainedTokenizerFast  # isort: skip
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers  # isort: skip

MARKERS = ["<|im_start|>", "<|im_end|>"]
CORPUS = [
    "You are a helpful assistant. What is the capital of France? Paris, of course!",
    "  two  spaces\n\nand lines\t and tabs, digits 12345 67.89 and ünïcödé 你好 🙂",
    'system user assistant tool call results: {"a": 1, "b": [2, 3]}',
] * 20
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _trained(pre: Any, extra: list[AddedToken] | None = None) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *MARKERS])
    tok.train_from_iterator(CORPUS, trainer)
    if extra:
        tok.add_special_tokens(extra)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = TEMPLATE
    return fast


def byte_level() -> PreTrainedTokenizerFast:
    """GPT-2 / Llama-3 / Qwen style: byte-level BPE, role markers as added tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=MARKERS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = TEMPLATE
    return fast


def metaspace(scheme: str) -> PreTrainedTokenizerFast:
    """Llama-2 / Mistral style: a Metaspace pre-tokenizer prepending "▁"."""
    return _trained(pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme))


def with_stripping_token() -> PreTrainedTokenizerFast:
    """An added token that eats the spaces around it: never cut at, left to the tokenizer."""
    return _trained(
        pre_tokenizers.Whitespace(), [AddedToken("<mask>", lstrip=True, rstrip=True, special=True)]
    )


TOKENIZERS = {
    "tiny": lambda: AutoTokenizer.from_pretrained(tiny_model_path()),
    "byte-level": byte_level,
    "metaspace-always": lambda: metaspace("always"),
    "metaspace-first": lambda: metaspace("first"),
    "stripping-token": with_stripping_token,
}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return TOKENIZERS[request.param]()


def whole(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def test_a_conversation_s_turns_come_out_as_whole_and_reuse_earlier_pieces(
    tokenizer: Any,
) -> None:
    enc = SegmentEncoder(tokenizer)
    rng = random.Random(7)
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 30}]
    for turn in range(6):
        messages.append({"role": "user", "content": f" question {rng.random()} ünï 🙂\n" * 3})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert enc(text) == whole(tokenizer, text), f"turn {turn}"
        messages.append({"role": "assistant", "content": f"\nanswer {turn}  " * 4})
    if enc.splits:
        assert enc.hits >= 5 * 2  # the system prompt and earlier messages, from turn 2 on


def test_which_tokenizers_are_split() -> None:
    assert SegmentEncoder(byte_level()).splits
    assert SegmentEncoder(metaspace("always")).splits
    # "first" prepends only at the input's start: a piece alone would gain a "▁"
    first = SegmentEncoder(metaspace("first"))
    assert not first.splits or all(
        first(t) == whole(first.tokenizer, t) for t in ["<|im_start|>user\nhi", "a<|im_end|> b"]
    )
    stripping = SegmentEncoder(with_stripping_token())
    assert "<mask>" not in stripping._added  # never cut at


PIECES = st.sampled_from(
    ["<|im_start|>", "<|im_end|>", "<mask>", " ", "  ", "\n", "\t", "a", "Paris", " of",
     "12", "3.5", "ü", "你好", "🙂", "system", "<|im", "end|>", "▁", "\"a\": [1]"]
)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(st.lists(PIECES, max_size=30), st.integers(0, 3))
def test_any_text_comes_out_as_whole(pieces: list[str], repeat: int) -> None:
    for name in ("byte-level", "metaspace-always", "metaspace-first", "stripping-token"):
        enc = _ENCODERS.setdefault(name, SegmentEncoder(TOKENIZERS[name]()))
        text = "".join(pieces) * (repeat + 1)
        assert enc(text) == whole(enc.tokenizer, text), (name, text)
        assert enc(text) == whole(enc.tokenizer, text), (name, text)  # from the cache


_ENCODERS: dict[str, SegmentEncoder] = {}


def test_the_cache_stays_within_its_bound() -> None:
    enc = SegmentEncoder(byte_level(), max_chars=4000)
    for i in range(50):
        enc(f"<|im_start|>user\n{'x' * 100} {i}<|im_end|>")
    assert enc.cached_chars <= 4000
    assert enc.cached_chars == sum(len(k) for k in enc._ids)
