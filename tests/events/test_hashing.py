"""Block hashing: chained, canonical, deterministic, and byte-identical to vLLM's sha256_cbor."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys

import pytest
import xxhash

from kvroute.events import BlockHasher, HashConfig, regime_salt, to_external


# -- an independent, minimal canonical-CBOR encoder (RFC 8949 §4.2.1) for the vectors ----
def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | info]) + struct.pack(fmt, n)
    raise ValueError(n)


def cbor(x: object) -> bytes:
    if x is None:
        return b"\xf6"
    if isinstance(x, int):
        return _cbor_head(0, x) if x >= 0 else _cbor_head(1, -1 - x)
    if isinstance(x, bytes):
        return _cbor_head(2, len(x)) + x
    if isinstance(x, str):
        raw = x.encode()
        return _cbor_head(3, len(raw)) + raw
    if isinstance(x, (list, tuple)):
        return _cbor_head(4, len(x)) + b"".join(cbor(i) for i in x)
    raise TypeError(type(x))


def vllm_reference(tokens, block_size, seed, salt=None, lora=None, lora_path=None):
    """vLLM's scheme written out from its spec: H(x) = sha256(cbor(x)). With ``lora_path``
    (vLLM 0.32): extra keys tagged by source, ("lora", name, path) and ("cache_salt", s)."""
    none_hash = hashlib.sha256(cbor(seed)).digest()
    parent, out = none_hash, []
    for i in range(len(tokens) // block_size):
        extra = ([lora] if lora else []) + ([salt] if salt and i == 0 else [])
        if lora_path is not None:
            extra = ([("lora", lora, lora_path)] if lora else []) + (
                [("cache_salt", salt)] if salt and i == 0 else []
            )
        item = [parent, tokens[i * block_size : (i + 1) * block_size], extra or None]
        parent = hashlib.sha256(cbor(item)).digest()
        out.append(parent)
    return out


def xxh3_reference(tokens, block_size, seed, salt=None, lora=None):
    """The documented xxh3_128 layout, written out independently."""

    def extra(tag, value):
        raw = value.encode()
        return bytes([tag]) + struct.pack("<I", len(raw)) + raw

    parent, out = xxhash.xxh3_128_digest(b"kvroute:" + seed.encode()), []
    for i in range(len(tokens) // block_size):
        blk = tokens[i * block_size : (i + 1) * block_size]
        data = parent + struct.pack("<I", block_size) + struct.pack(f"<{block_size}I", *blk)
        if lora:
            data += extra(1, lora)
        if salt and i == 0:
            data += extra(2, salt)
        parent = xxhash.xxh3_128_digest(data)
        out.append(parent)
    return out


TOKENS = [(i * 7919 + 13) % 151_936 for i in range(100)]


@pytest.mark.parametrize("salt,lora", [(None, None), ("tenant-a", None), (None, "ad"), ("s", "ad")])
def test_sha256_cbor_matches_vllm_spec(salt, lora):
    h = BlockHasher("sha256_cbor", seed="vllm-none-hash", block_size=16)
    assert h.hash_blocks(TOKENS, cache_salt=salt, lora_name=lora) == vllm_reference(
        TOKENS, 16, "vllm-none-hash", salt, lora
    )


@pytest.mark.parametrize("salt,lora", [(None, None), ("tenant-a", None), (None, "ad"), ("s", "ad")])
def test_sha256_cbor_tagged_matches_vllm_032_spec(salt, lora):
    h = BlockHasher("sha256_cbor_tagged", seed="vllm-none-hash", block_size=16)
    got = h.hash_blocks(TOKENS, cache_salt=salt, lora_name=lora, lora_path="/adapters/ad")
    assert got == vllm_reference(TOKENS, 16, "vllm-none-hash", salt, lora, "/adapters/ad")
    if not salt and not lora:  # unsalted, the two layouts agree
        assert got == BlockHasher("sha256_cbor", block_size=16).hash_blocks(TOKENS)
    elif salt:
        assert got != BlockHasher("sha256_cbor", block_size=16).hash_blocks(TOKENS, cache_salt=salt)


def test_sha256_cbor_tagged_needs_a_loras_path():
    h = BlockHasher("sha256_cbor_tagged", block_size=16)
    with pytest.raises(ValueError, match="lora_path"):
        h.hash_blocks(TOKENS, lora_name="ad")


def test_sha256_cbor_large_token_ids_use_wide_cbor_ints():
    toks = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1] * 2
    h = BlockHasher("sha256_cbor", seed="42", block_size=8)
    assert h.hash_blocks(toks) == vllm_reference(toks, 8, "42")


@pytest.mark.parametrize("salt,lora", [(None, None), ("tenant-a", None), (None, "ad"), ("s", "ad")])
def test_xxh3_matches_documented_layout(salt, lora):
    h = BlockHasher("xxh3_128", seed="fleet-1", block_size=16)
    got = h.hash_blocks(TOKENS, cache_salt=salt, lora_name=lora)
    assert got == xxh3_reference(TOKENS, 16, "fleet-1", salt, lora)
    assert all(len(x) == 16 for x in got)


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256_cbor"])
def test_only_full_blocks_and_chaining(algo):
    h = BlockHasher(algo, block_size=16)
    assert h.hash_blocks(TOKENS[:15]) == []
    full = h.hash_blocks(TOKENS)
    assert len(full) == 100 // 16
    assert h.hash_blocks(TOKENS[:99]) == full  # a partial tail changes nothing
    # changing one token of block 2 changes block 2 and every later block, nothing before
    t = list(TOKENS)
    t[40] += 1
    changed = h.hash_blocks(t)
    assert changed[:2] == full[:2]
    assert all(a != b for a, b in zip(changed[2:], full[2:], strict=True))


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256_cbor"])
def test_continuing_a_chain_equals_hashing_at_once(algo):
    h = BlockHasher(algo, block_size=16)
    full = h.hash_blocks(TOKENS, cache_salt="s", lora_name="l")
    head = h.hash_blocks(TOKENS[:32], cache_salt="s", lora_name="l")
    rest = h.hash_blocks(TOKENS[32:], cache_salt="s", lora_name="l", parent=head[-1], start_block=2)
    assert head + rest == full
    with pytest.raises(ValueError):
        h.hash_blocks(TOKENS, parent=head[-1])


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256_cbor"])
def test_salt_seed_block_size_and_algo_all_change_hashes(algo):
    base = BlockHasher(algo, seed="a", block_size=16).hash_blocks(TOKENS)
    salted = BlockHasher(algo, seed="a", block_size=16).hash_blocks(TOKENS, cache_salt="t1")
    other_salt = BlockHasher(algo, seed="a", block_size=16).hash_blocks(TOKENS, cache_salt="t2")
    assert not set(base) & set(salted)  # the salt reaches every block through the chain
    assert not set(salted) & set(other_salt)
    assert not set(base) & set(BlockHasher(algo, seed="b", block_size=16).hash_blocks(TOKENS))
    assert not set(base) & set(BlockHasher(algo, seed="a", block_size=8).hash_blocks(TOKENS))
    other = "sha256_cbor" if algo == "xxh3_128" else "xxh3_128"
    assert not set(base) & set(BlockHasher(other, seed="a", block_size=16).hash_blocks(TOKENS))


def test_inputs_of_other_int_types_hash_the_same():
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    h = BlockHasher(block_size=16)
    ref = h.hash_blocks(TOKENS)
    assert h.hash_blocks(np.array(TOKENS, dtype=np.int64)) == ref
    assert h.hash_blocks(torch.tensor(TOKENS).tolist()) == ref
    assert h.hash_blocks(tuple(TOKENS)) == ref


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        BlockHasher("md5")
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(block_size=0)
    with pytest.raises(OverflowError):
        BlockHasher().hash_blocks([-1] * 16)


@pytest.mark.parametrize("accelerate", [False, None])
def test_bad_tokens_are_named_in_the_error(accelerate):
    h = BlockHasher(block_size=4, accelerate=accelerate)
    with pytest.raises(OverflowError, match=r"uint32.*token 2 is -1"):
        h.hash_blocks([1, 2, -1, 3])
    with pytest.raises(OverflowError, match=r"token 3 is 4294967296"):
        h.hash_blocks((1, 2, 3, 2**32))
    # a float or numeric string is not silently truncated or parsed
    with pytest.raises(TypeError, match=r"token 1 is float 1.5"):
        h.hash_blocks([1, 1.5, 2, 3])
    with pytest.raises(TypeError, match=r"token 0 is str '5'"):
        h.hash_blocks(["5", 1, 2, 3])
    with pytest.raises(TypeError, match="not str"):
        h.hash_blocks("0123")
    with pytest.raises(ValueError, match="16-byte"):
        h.hash_blocks([1, 2, 3, 4], parent=b"\0" * 32, start_block=1)


def test_external_forms():
    digest = bytes(range(32))
    assert to_external(digest, "bytes") == digest
    assert to_external(digest, "int") == int.from_bytes(bytes(range(24, 32)), "big")
    assert to_external(b"\xff" * 16, "int") == 2**64 - 1
    with pytest.raises(ValueError):
        to_external(digest, "hex")  # type: ignore[arg-type]


def test_config_mismatch_names_the_difference():
    a = HashConfig("xxh3_128", "s", 16)
    assert a.mismatch(HashConfig("xxh3_128", "s", 16)) is None
    why = a.mismatch(HashConfig("sha256_cbor", "s", 32))
    assert "algo" in why and "block_size" in why and "seed" not in why


def test_deterministic_across_processes():
    code = (
        "import json,sys;from kvroute.events import BlockHasher;"
        "t=list(range(1000,1100));"
        "print(json.dumps({a: [h.hex() for h in BlockHasher(a, seed='x').hash_blocks(t, "
        "cache_salt='s')] for a in ('xxh3_128','sha256_cbor')}))"
    )
    outs = [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(i), "PATH": ""},
        ).stdout
        for i in (1, 2)
    ]
    assert outs[0] == outs[1]
    here = {
        a: [
            h.hex()
            for h in BlockHasher(a, seed="x").hash_blocks(list(range(1000, 1100)), cache_salt="s")
        ]
        for a in ("xxh3_128", "sha256_cbor")
    }
    assert json.loads(outs[0]) == here


def test_regime_salt_parts_prompts_past_a_rotary_switch():
    """Past the switch a prompt gets its own salt (its tenant's kept in front of it), so its
    blocks never equal a shorter prompt's; up to it, and with no switch, nothing changes."""
    tokens = list(range(64))
    hasher = BlockHasher(block_size=16)
    assert regime_salt("t", 64, None) == "t" and regime_salt(None, 64, 64) is None
    long, short = regime_salt("t", 64, 63), regime_salt("t", 63, 63)
    assert short == "t" and long != "t" and long.startswith("t")
    assert regime_salt(None, 64, 63) == regime_salt("", 64, 63)
    # the same tokens under the two regimes: no block in common, tenants still apart
    assert not set(hasher.hash_blocks(tokens, cache_salt=long)) & set(
        hasher.hash_blocks(tokens, cache_salt=short)
    )
    assert regime_salt("u", 64, 63) != long


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256_cbor_tagged"])
def test_a_memo_gives_the_same_hashes_and_stays_within_its_bound(algo: str) -> None:
    """Kept block hashes (a router's shared prefixes) are the hashes made afresh, whatever
    the salt, adapter or chain they came with; the memo never holds more than asked."""
    plain, kept = BlockHasher(algo, block_size=4), BlockHasher(algo, block_size=4, memo=16)
    prefix = list(range(100, 120))
    for i in range(30):
        tokens = [*prefix, i, i + 1, i + 2, i + 3, 7]
        for salt in (None, "s", "t", "lora"):
            for lora in (None, "lora", "s"):
                kw = {"lora_path": "/a"} if lora and algo == "sha256_cbor_tagged" else {}
                want = plain.hash_blocks(tokens, cache_salt=salt, lora_name=lora, **kw)
                assert kept.hash_blocks(tokens, cache_salt=salt, lora_name=lora, **kw) == want
                assert kept.hash_blocks(tokens, cache_salt=salt, lora_name=lora, **kw) == want
        head = plain.hash_blocks(tokens[:8])
        tail = plain.hash_blocks(tokens[8:], parent=head[-1], start_block=2, cache_salt="s")
        assert kept.hash_blocks(tokens[8:], parent=head[-1], start_block=2, cache_salt="s") == tail
        assert len(kept._memo) <= 16
