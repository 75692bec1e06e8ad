"""Triton kernels against the torch reference and the dense oracle.

Runs on CUDA (``-m gpu``). Without CUDA the same tests run on CPU under Triton's
interpreter: ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` before anything imports
Triton (it reads the variable when a kernel is decorated), and the test extra installs
Triton, so CI runs them. The compile test (LLVM and ptxas for sm80/sm90) needs kernels
decorated for compilation: under the interpreter it runs itself in a fresh process.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from kvroute.kernels import reference

from .batches import SCENARIOS, dense_attention, make_batch, tolerance

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"

DEVICES = [
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                not (torch.cuda.is_available() and HAS_TRITON) or INTERPRET,
                reason="needs CUDA and Triton (not interpreted)",
            ),
        ],
    ),
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(not INTERPRET, reason="needs Triton with TRITON_INTERPRET=1"),
    ),
]


def _tk() -> ModuleType:
    from kvroute.kernels import triton_kernels

    return triton_kernels


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_reference(device: str, block_size: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(block_size)
    num_blocks, hk, d, n = 64 // block_size + 4, 4, 32, 40
    shape = (num_blocks, block_size, hk, d)
    k_ref = torch.randn(shape, generator=g).to(dtype)
    v_ref = torch.randn(shape, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    slots[::5] = -1
    key = torch.randn(n + 2, hk, d, generator=g).to(dtype)  # two rows past slot_mapping
    value = torch.randn(n + 2, hk, d, generator=g).to(dtype)
    k_tri, v_tri = k_ref.to(device), v_ref.to(device)
    reference.store_kv(key, value, k_ref, v_ref, slots)
    _tk().store_kv(key.to(device), value.to(device), k_tri, v_tri, slots.to(device))
    assert torch.equal(k_tri.cpu(), k_ref)
    assert torch.equal(v_tri.cpu(), v_ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hint", [True, False])
def test_paged_attention_matches(
    device: str, scenario: str, group: int, block_size: int, dtype: torch.dtype, hint: bool
) -> None:
    if device == "cpu" and dtype == torch.bfloat16:
        # float16 runs the same low-precision branch of the kernel and is interpreted fine.
        pytest.skip("Triton 3.9's interpreter computes bf16 tl.dot wrongly (raw bits)")
    specs = SCENARIOS[scenario]
    batch = make_batch(
        specs,
        num_heads=4 * group,
        num_kv_heads=4,
        block_size=block_size,
        dtype=dtype,
        device=device,
        padding_rows=3,
        seed=group + block_size,
    )
    tk = _tk()
    tk.store_kv(batch.new_keys, batch.new_values, batch.k_cache, batch.v_cache, batch.slot_mapping)
    hints = {"max_query_len": max(q for _, q in specs)} if hint else {}
    out = tk.paged_attention(*batch.inputs(**hints), scale=batch.scale)
    want = reference.paged_attention(*batch.inputs(), scale=batch.scale)
    assert out.dtype == dtype and out.shape == batch.query.shape
    assert not out.isnan().any()
    # fp32: the kernel's dots are IEEE, so it must match closely; bf16: P is rounded for P@V.
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else tolerance(dtype)
    torch.testing.assert_close(out.cpu().float(), want.cpu().float(), **tol)
    torch.testing.assert_close(out.cpu().double(), dense_attention(batch), **tolerance(dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(16, 1, 24), (9, 3, 64)],  # odd head_dim, big group; SmolLM2-135M's group of 3
)
@pytest.mark.parametrize("max_query_len", [None, 5])
def test_odd_shapes(
    device: str, heads: int, kv_heads: int, head_dim: int, max_query_len: int | None
) -> None:
    batch = make_batch(
        [(30, 5), (0, 1), (77, 1), (3, 4)],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=8,
        device=device,
    )
    tk = _tk()
    tk.store_kv(batch.new_keys, batch.new_values, batch.k_cache, batch.v_cache, batch.slot_mapping)
    out = tk.paged_attention(*batch.inputs(max_query_len=max_query_len), scale=batch.scale)
    torch.testing.assert_close(out.cpu().double(), dense_attention(batch), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_launch_config() -> None:
    cfg = _tk().launch_config(8, 4, 32, max_query_len=1)
    assert cfg == {"GROUP": 2, "BLOCK_M": 16, "BLOCK_Q": 8, "DIM_PAD": 32, "TILE_N": 64}
    cfg = _tk().launch_config(32, 1, 128, max_query_len=None)
    assert cfg["BLOCK_M"] == 64 and cfg["BLOCK_Q"] == 2 and cfg["TILE_N"] == 32
    cfg = _tk().launch_config(64, 1, 8, max_query_len=1)
    assert cfg["BLOCK_M"] == 64 and cfg["BLOCK_Q"] == 1 and cfg["DIM_PAD"] == 16


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kernels_compile_for_ampere_and_hopper(dtype: str) -> None:
    """Front end, LLVM and ptxas, for sm80 and sm90, without a GPU: catches type and shape
    errors that the interpreter lets through. Uses Triton's ASTSource API (3.x)."""
    if INTERPRET:  # kernels decorated for the interpreter cannot compile: a fresh process
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        test = f"{__file__}::test_kernels_compile_for_ampere_and_hopper[{dtype}]"
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert out.returncode == 0 and " passed" in out.stdout, out.stdout[-4000:]
        return
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tk = _tk()

    def signature(fn: Callable, pointers: dict[str, str], consts: dict) -> dict[str, str]:
        kinds = {"scale_log2": "fp32", **pointers, **dict.fromkeys(consts, "constexpr")}
        return {name: kinds.get(name, "i32") for name in fn.arg_names}

    cache = {n: f"*{dtype}" for n in ("k_cache_ptr", "v_cache_ptr")}
    for arch in (80, 90):
        target = GPUTarget("cuda", arch, 32)
        consts = {"BLOCK_SIZE": 16, "HEADS_PAD": 8, "DIM_PAD": 128}
        ptrs = {**cache, "key_ptr": f"*{dtype}", "value_ptr": f"*{dtype}", "slot_ptr": "*i64"}
        fn = tk._store_kv_kernel
        triton.compile(ASTSource(fn, signature(fn, ptrs, consts), consts), target=target)
        for heads, kv_heads, head_dim, max_q in ((8, 4, 32, 1), (32, 8, 128, None)):
            cfg = tk.launch_config(heads, kv_heads, head_dim, max_q)
            consts = {"HEAD_DIM": head_dim, "BLOCK_SIZE": 16, "IEEE": dtype == "fp32", **cfg}
            ptrs = {**cache, "out_ptr": f"*{dtype}", "q_ptr": f"*{dtype}"}
            ptrs |= {n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")}
            fn = tk._paged_attention_kernel
            src = ASTSource(fn, signature(fn, ptrs, consts), consts)
            triton.compile(src, target=target, options={"num_warps": 4})
