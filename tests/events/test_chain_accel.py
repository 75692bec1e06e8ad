"""The compiled xxh3_128 chain loop (kvroute.events._chain) against the pure-Python path.

The accelerator is optional, so every test here needs it built and skips (with the reason)
when it is not; the pure path's own correctness is pinned by test_hashing.py.
"""

from __future__ import annotations

import random
import threading
from array import array
from typing import Any

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.events import BlockHasher
from kvroute.events import hashing as hashing_mod

try:
    from kvroute.events import _chain  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on the build
    _chain = None

pytestmark = pytest.mark.skipif(
    _chain is None, reason="kvroute.events._chain is not built (no C compiler at install time?)"
)


def test_built_extension_passes_its_self_check():
    # Built but rejected (wrong symbol, wrong bytes) is a failure, not a reason to skip.
    assert hashing_mod._accelerator() is not None


def pair(block_size: int = 16, seed: str = "s") -> tuple[BlockHasher, BlockHasher]:
    """(accelerated, pure) hashers for one config."""
    fast = BlockHasher("xxh3_128", seed, block_size, accelerate=True)
    pure = BlockHasher("xxh3_128", seed, block_size, accelerate=False)
    assert fast.accelerated and not pure.accelerated
    return fast, pure


def outcome(h: BlockHasher, tokens: Any, **kw: Any) -> tuple[str, object]:
    """The result of hash_blocks, or the exception's type and message."""
    try:
        return ("ok", h.hash_blocks(tokens, **kw))
    except Exception as e:
        return (type(e).__name__, str(e))


names = st.one_of(st.none(), st.just(""), st.text(max_size=12))


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=300),
    block_size=st.integers(1, 40),
    seed=st.text(max_size=8),
    salt=names,
    lora=names,
    as_tuple=st.booleans(),
)
def test_same_digests_as_pure_path(tokens, block_size, seed, salt, lora, as_tuple):
    fast, pure = pair(block_size, seed)
    inp = tuple(tokens) if as_tuple else tokens
    got = fast.hash_blocks(inp, cache_salt=salt, lora_name=lora)
    assert got == pure.hash_blocks(inp, cache_salt=salt, lora_name=lora)
    assert len(got) == len(tokens) // block_size


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=200),
    block_size=st.integers(1, 16),
    cut=st.integers(0, 20),
    salt=names,
    lora=names,
)
def test_continued_chain_matches(tokens, block_size, cut, salt, lora):
    fast, pure = pair(block_size)
    full = pure.hash_blocks(tokens, cache_salt=salt, lora_name=lora)
    start = min(cut, len(full))
    if start == 0:
        return
    parent = full[start - 1]
    rest = tokens[start * block_size :]
    kw = {"cache_salt": salt, "lora_name": lora, "parent": parent, "start_block": start}
    assert fast.hash_blocks(rest, **kw) == pure.hash_blocks(rest, **kw) == full[start:]


def test_long_prompts_and_both_gil_branches():
    rng = random.Random(7)
    for n in (0, 15, 16, 17, 63 * 16, 64 * 16, 32_768, 32_768 + 5):
        tokens = [rng.randrange(2**32) for _ in range(n)]
        fast, pure = pair(16)
        for kw in (
            {},
            {"cache_salt": "tenant"},
            {"lora_name": "ad"},
            {"cache_salt": "é", "lora_name": "ü"},
        ):
            assert fast.hash_blocks(tokens, **kw) == pure.hash_blocks(tokens, **kw)


def test_numpy_torch_and_other_int_inputs():
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    rng = random.Random(3)
    toks = [rng.randrange(151_936) for _ in range(16 * 9 + 3)]
    fast, pure = pair(16)
    ref = pure.hash_blocks(toks, lora_name="l")
    inputs = [
        np.array(toks, dtype=np.int64),
        np.array(toks, dtype=np.int32),
        np.array(toks, dtype=np.uint32),
        np.array(toks, dtype=np.uint64),
        torch.tensor(toks),
        torch.tensor(toks, dtype=torch.int32),
        [np.int64(t) for t in toks],  # a list, but not of exact ints: the C code declines
        array("I", toks),
    ]
    for inp in inputs:
        assert fast.hash_blocks(inp, lora_name="l") == ref, type(inp)
        assert pure.hash_blocks(inp, lora_name="l") == ref, type(inp)
    assert fast.hash_blocks(range(40)) == pure.hash_blocks(list(range(40)))
    assert fast.hash_blocks([True] * 16) == pure.hash_blocks([1] * 16)  # bool is an int


BAD = [
    [-1] * 16,
    [2**32] * 16,
    [1] * 15 + [2**64],
    [1] * 8 + [-(2**70)] + [1] * 7,
    [1.5] * 16,
    ["5"] * 16,
    [None] * 16,
    [1] * 15 + [object()],
    (1,) * 15 + (-3,),
    b"\x00" * 64,
    "0123456789abcdef",
    bytearray(64),
]


@pytest.mark.parametrize("bad", BAD, ids=range(len(BAD)))
def test_same_errors_for_bad_tokens(bad):
    fast, pure = pair(16)
    got = outcome(fast, bad)
    assert got[0] in ("TypeError", "OverflowError"), got
    assert got == outcome(pure, bad)


def test_bad_token_errors_from_numpy_and_torch_match():
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    fast, pure = pair(4)
    for bad in (
        np.array([1, 2, -1, 3]),
        np.array([1.0, 2.0, 3.0, 4.0]),
        torch.tensor([1, 2, 3, 2**33]),
        torch.tensor([1.0, 2.0, 3.0, 4.0]),
    ):
        got = outcome(fast, bad)
        assert got[0] in ("TypeError", "OverflowError"), (bad, got)
        assert got == outcome(pure, bad)


def test_tokens_past_the_last_full_block_are_not_read():
    fast, pure = pair(4)
    toks = [1, 2, 3, 4, -1, "x"]
    assert fast.hash_blocks(toks) == pure.hash_blocks(toks) == pure.hash_blocks(toks[:4])


def test_concurrent_threads_get_the_same_hashes():
    fast, pure = pair(16)
    rng = random.Random(11)
    prompts = [[rng.randrange(2**32) for _ in range(16 * 300)] for _ in range(4)]
    want = [pure.hash_blocks(p) for p in prompts]
    got: list[list[bytes] | None] = [None] * len(prompts)

    def work(i: int) -> None:
        for _ in range(20):
            got[i] = fast.hash_blocks(prompts[i])
            assert got[i] == want[i]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


def test_env_var_forces_the_pure_path(monkeypatch):
    assert hashing_mod.PURE_PYTHON_ENV == "KVROUTE_PURE_PYTHON_HASH"  # docs/extending.md's name
    monkeypatch.setenv(hashing_mod.PURE_PYTHON_ENV, "1")
    assert not BlockHasher().accelerated
    assert BlockHasher(accelerate=True).accelerated  # an explicit request wins
    monkeypatch.setenv(hashing_mod.PURE_PYTHON_ENV, "0")
    assert BlockHasher().accelerated
    monkeypatch.delenv(hashing_mod.PURE_PYTHON_ENV)
    assert BlockHasher().accelerated
    assert not BlockHasher("sha256_cbor").accelerated


def test_missing_extension_falls_back_or_fails_when_required(monkeypatch):
    want = BlockHasher(accelerate=True).hash_blocks(list(range(32)))
    monkeypatch.delenv(hashing_mod.PURE_PYTHON_ENV, raising=False)
    monkeypatch.setattr(hashing_mod, "_accelerator", lambda: None)
    h = BlockHasher()
    assert not h.accelerated
    assert h.hash_blocks(list(range(32))) == want
    with pytest.raises(ImportError, match="_chain"):
        BlockHasher(accelerate=True)


def test_self_check_rejects_a_wrong_hash():
    class Wrong:
        def bind(self, path: str) -> None:
            pass

        def xxh3_chain(self, *args: object) -> list[bytes]:
            return [b"\x00" * 16] * 4

    assert hashing_mod._self_check(_chain)
    assert not hashing_mod._self_check(Wrong())


def test_c_entry_point_validates_its_arguments():
    parent, header = b"\x00" * 16, b"\x02\x00\x00\x00"
    with pytest.raises(TypeError):
        _chain.xxh3_chain([1, 2], 2, 2, parent, header, b"")
    with pytest.raises(ValueError, match="16 bytes"):
        _chain.xxh3_chain([1, 2], 2, 2, b"short", header, b"", b"")
    with pytest.raises(ValueError, match="multiple"):
        _chain.xxh3_chain([1, 2, 3], 3, 2, parent, header, b"", b"")
    with pytest.raises(ValueError, match="fewer tokens"):
        _chain.xxh3_chain([1, 2], 4, 2, parent, header, b"", b"")
    with pytest.raises(ValueError, match="shorter"):
        _chain.xxh3_chain(b"\x00" * 12, 4, 2, parent, header, b"", b"")
    with pytest.raises(TypeError, match="bytes"):
        _chain.xxh3_chain([1, 2], 2, 2, parent, "hdr", b"", b"")
    assert _chain.xxh3_chain([1, -2], 2, 2, parent, header, b"", b"") is None
    # one block by hand: parent | header | tokens LE | tail
    got = _chain.xxh3_chain([1, 2], 2, 2, parent, header, b"T", b"")
    assert got == [xxhash.xxh3_128_digest(parent + header + b"\x01\0\0\0\x02\0\0\0" + b"T")]


def test_bind_errors_are_oserrors_and_rebinding_works():
    try:
        with pytest.raises(OSError, match="dlopen"):
            _chain.bind("/nonexistent/libnothing.so")
        import ctypes.util

        libm = ctypes.util.find_library("m")
        if libm:
            with pytest.raises(OSError, match="XXH3_128bits"):
                _chain.bind(libm)
    finally:
        _chain.bind(xxhash._xxhash.__file__)
    assert hashing_mod._self_check(_chain)
