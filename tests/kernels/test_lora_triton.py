"""The Triton LoRA kernel (kernels/lora_triton.py) against one row at a time.

Without CUDA the kernels run under Triton's interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1``); on CUDA they run compiled (``-m gpu``) and are checked against the
torch path. A compile test builds them for sm80 and sm90 without a GPU, as
``test_triton.py`` does for attention.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from kvroute.kernels.lora import LoRAMapping, add_lora

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
RUNNABLE = INTERPRET or (HAS_TRITON and torch.cuda.is_available())
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"


def _one_row_at_a_time(y, x, a, bs, row_slot, rank):  # type: ignore[no-untyped-def]
    want = y.clone().double()
    for t, s in enumerate(row_slot):
        if s >= 0:
            u = x[t].double() @ a[s].double()
            parts = [u[i * rank : (i + 1) * rank] @ b[s].double() for i, b in enumerate(bs)]
            want[t] += torch.cat(parts)
    return want


@pytest.mark.skipif(not RUNNABLE, reason="needs Triton (interpreted without CUDA)")
@pytest.mark.parametrize(
    ("rank", "outs", "row_slot"),
    [
        # decode-like: one row per request, slots mixed with base rows (-1), one slot empty
        (8, [16, 8, 8], [2, -1, 0, 2, 4, -1, 0, 2, 2, 4, -1]),
        # a prefill's run of 40 rows on one slot (three tiles, the last partial) and others
        (16, [48], [1] * 40 + [-1] * 3 + [3] * 17 + [0]),
        # rank 64 over three targets: the shrink's 192 columns take two column blocks
        (64, [32, 16, 16], [0, 1, 2, 3, -1, 1, 1, 0]),
    ],
)
def test_triton_kernel_equals_one_row_at_a_time(
    rank: int, outs: list[int], row_slot: list[int]
) -> None:
    gen = torch.Generator().manual_seed(rank)
    slots, fan_in = 5, 40  # fan_in not a multiple of the kernel's K block
    a = torch.randn(slots, fan_in, rank * len(outs), generator=gen)
    bs = [torch.randn(slots, rank, o, generator=gen) for o in outs]
    x = torch.randn(len(row_slot), fan_in, generator=gen)
    y = torch.randn(len(row_slot), sum(outs), generator=gen)
    want = _one_row_at_a_time(y, x, a, bs, row_slot, rank)
    dev = torch.device(DEVICE)
    spans = [(s, t, 1) for t, s in enumerate(row_slot) if s >= 0]
    mapping = LoRAMapping.build(spans, slots, dev, "triton")
    assert mapping is not None and mapping.kernel == "triton"
    assert mapping.tile_slot is not None
    # no tile crosses a slot: each tile's rows all belong to its slot
    owner = {t: s for t, s in enumerate(row_slot)}
    rows = mapping.rows.tolist()
    assert mapping.tile_start is not None and mapping.tile_end is not None
    tiles = zip(
        mapping.tile_start.tolist(),
        mapping.tile_end.tolist(),
        mapping.tile_slot.tolist(),
        strict=True,
    )
    for start, end, slot in tiles:
        assert 0 < end - start <= 16 and {owner[r] for r in rows[start:end]} == {slot}
    got = y.to(dev)
    add_lora(got, x.to(dev), a.to(dev), [b.to(dev) for b in bs], mapping)
    torch.testing.assert_close(got.cpu().double(), want, atol=1e-4, rtol=1e-4)
    base = [t for t, s in enumerate(row_slot) if s < 0]
    assert torch.equal(got.cpu()[base], y[base])  # base rows untouched


@pytest.mark.skipif(not RUNNABLE, reason="needs Triton (interpreted without CUDA)")
@pytest.mark.skipif(
    not hasattr(torch.nn.functional, "grouped_mm"), reason="this torch has no grouped_mm"
)
def test_triton_kernel_equals_the_grouped_path() -> None:
    """The same batch through the CPU's grouped path and through Triton."""
    gen = torch.Generator().manual_seed(3)
    slots, fan_in, rank, outs = 4, 64, 16, [64, 32, 32]
    row_slot = [0] * 20 + [-1] * 5 + [1, 2, 3, 1, 2, 3, -1]
    a = torch.randn(slots, fan_in, rank * len(outs), generator=gen)
    bs = [torch.randn(slots, rank, o, generator=gen) for o in outs]
    x = torch.randn(len(row_slot), fan_in, generator=gen)
    y = torch.randn(len(row_slot), sum(outs), generator=gen)
    spans = [(s, t, 1) for t, s in enumerate(row_slot) if s >= 0]
    torch_y = y.clone()
    grouped = LoRAMapping.build(spans, slots, torch.device("cpu"), "grouped")
    assert grouped is not None
    add_lora(torch_y, x, a, bs, grouped)
    dev = torch.device(DEVICE)
    triton_y = y.to(dev)
    mapping = LoRAMapping.build(spans, slots, dev, "triton")
    assert mapping is not None
    add_lora(triton_y, x.to(dev), a.to(dev), [b.to(dev) for b in bs], mapping)
    torch.testing.assert_close(triton_y.cpu(), torch_y, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_lora_kernels_compile_for_ampere_and_hopper(dtype: str) -> None:
    """Front end, LLVM and ptxas for sm80 and sm90, without a GPU."""
    if INTERPRET:  # kernels decorated for the interpreter cannot compile: a fresh process
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        test = f"{__file__}::test_lora_kernels_compile_for_ampere_and_hopper[{dtype}]"
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert out.returncode == 0 and " passed" in out.stdout, out.stdout[-4000:]
        return
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvroute.kernels import lora_triton as lt

    for arch in (80, 90):
        target = GPUTarget("cuda", arch, 32)
        for fn, consts, ptrs in (
            (
                lt._shrink_kernel,
                {"BLOCK_M": 16, "BLOCK_K": 32, "BLOCK_R": 64, "IEEE": dtype == "fp32"},
                {"x_ptr": f"*{dtype}", "a_ptr": f"*{dtype}", "u_ptr": "*fp32"},
            ),
            (
                lt._expand_kernel,
                {"BLOCK_M": 16, "BLOCK_RANK": 16, "BLOCK_N": 64, "IEEE": dtype == "fp32"},
                {"u_ptr": "*fp32", "b_ptr": f"*{dtype}", "y_ptr": f"*{dtype}"},
            ),
        ):
            index = {"rows_ptr": "*i64"} | dict.fromkeys(
                ("tile_start_ptr", "tile_end_ptr", "tile_slot_ptr"), "*i32"
            )
            kinds = {**ptrs, **index, **dict.fromkeys(consts, "constexpr")}
            sig = {n: kinds.get(n, "i32") for n in fn.arg_names}
            compiled = triton.compile(ASTSource(fn, sig, consts), target=target)
            assert compiled.asm.get("ptx")  # the back end ran to PTX
