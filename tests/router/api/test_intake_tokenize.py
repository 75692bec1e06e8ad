"""A text prompt's ids from the fast tokenizer's backend (:func:`fast_encoder`) are the ids
``tokenizer(text)`` gives: the router hashes what the engine will see."""

from __future__ import annotations

import random

import pytest

from kvroute.router.api.encode import fast_encoder


def test_the_backend_gives_the_tokenizers_ids() -> None:
    transformers = pytest.importorskip("transformers")
    from kvroute.replica.model.models import SMOLLM2_DIR_NAME, cache_dir

    folder = cache_dir() / "models" / SMOLLM2_DIR_NAME
    if not (folder / "tokenizer.json").is_file():
        pytest.skip("smollm2-135m is not downloaded")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    encode = fast_encoder(tok)
    assert encode.__name__ == "fast"
    rng = random.Random(0)
    for _ in range(20):
        text = tok.decode([rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 300))])
        assert encode(text) == list(tok(text).input_ids)


def test_a_tokenizer_without_a_backend_is_called_itself() -> None:
    class StandIn:
        def __call__(self, text: str) -> object:
            return type("E", (), {"input_ids": [len(text)]})()

    encode = fast_encoder(StandIn())
    assert encode.__name__ == "slow" and encode("abc") == [3]
