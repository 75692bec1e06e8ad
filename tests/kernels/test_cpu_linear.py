"""The tiled C linear kernel against ``F.linear``, on every instruction set it has, and the
replica's ``Linear`` choosing between it, oneDNN and plain torch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from kvroute.kernels import cpu_linear
from kvroute.replica.model.linear import Linear

pytestmark = pytest.mark.skipif(cpu_linear.isa() is None, reason="C linear kernel not built")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(got, want, atol=2e-6 * scale, rtol=1e-5)


# (N, K): one output; a tile's edge past 32 and below it; smollm2's QKV and down shapes
SHAPES = [(1, 1), (31, 17), (33, 576), (960, 576), (576, 1536)]
ROWS = [0, 1, 2, 3, 5, 8, 11, 17, 64]  # every chunk size of 8 / 4 / 2 / 1 and mixes of them


@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_f_linear(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * 1000 + k)
    weight = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    packed = cpu_linear.pack(weight)
    assert packed.shape == (-(-n // 32), k, 32)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=g)
        for b in (None, bias):
            _close(cpu_linear.linear(x, packed, b, n), F.linear(x, weight, b))


def test_strided_and_batched_inputs() -> None:
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(70, 40, generator=g)
    packed = cpu_linear.pack(weight)
    wide = torch.randn(6, 100, generator=g)
    x = wide[:, 10:50]  # rows of 40 with a stride of 100, read in place
    _close(cpu_linear.linear(x, packed, None, 70), F.linear(x, weight))
    x3 = torch.randn(2, 3, 40, generator=g)
    _close(cpu_linear.linear(x3, packed, None, 70), F.linear(x3, weight))
    with pytest.raises(ValueError, match="width 40"):
        cpu_linear.linear(torch.randn(2, 41), packed, None, 70)


_CHECK = """
import torch, torch.nn.functional as F
from kvroute.kernels import cpu_linear
print(cpu_linear.isa())
g = torch.Generator().manual_seed(0)
for n, k in [(31, 17), (960, 576), (70, 1536)]:
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    p = cpu_linear.pack(w)
    for rows in (1, 2, 3, 5, 8, 13):
        x = torch.randn(rows, k, generator=g)
        want = F.linear(x, w, b)
        err = float((cpu_linear.linear(x, p, b, n) - want).abs().max())
        assert err <= 1e-5 * max(1.0, float(want.abs().max())), (n, k, rows, err)
"""


@pytest.mark.parametrize("cap", ["avx2", "baseline"])
def test_every_instruction_set(cap: str) -> None:
    """The lower variants run where they are the best a CPU has; here they are forced."""
    env = dict(os.environ, KVROUTE_CPU_ISA=cap)
    out = subprocess.run(
        [sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    ran = out.stdout.split()[0]
    if cap == "avx2" and ran == "baseline":
        pytest.skip("this CPU has no AVX2")
    assert ran == cap


def test_replica_linear_picks_its_form() -> None:
    """One torch thread: the tiled kernel; more: oneDNN; both equal F.linear, and the
    plain weight is not kept beside the packed one."""
    g = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(100, 64, generator=g), torch.randn(100, generator=g)
    x = torch.randn(5, 64, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        tiled = Linear(weight, bias)
        torch.set_num_threads(2)
        other = Linear(weight, bias)
    finally:
        torch.set_num_threads(threads)
    assert tiled.form == "tiled" and tiled.weight is None
    assert other.form in ("onednn", "plain")
    for lin in (tiled, other):
        _close(lin(x), F.linear(x, weight, bias))
    assert Linear(weight, bias, prepack=False).form == "plain"


@pytest.mark.parametrize(
    "switch, form",
    [("KVROUTE_CPU_LINEAR", ("onednn", "plain")), ("KVROUTE_CPU_PREPACK", ("plain",))],
)
def test_the_switches_turn_the_packed_forms_off(
    monkeypatch: pytest.MonkeyPatch, switch: str, form: tuple[str, ...]
) -> None:
    """``KVROUTE_CPU_LINEAR=0``: no tiled kernel, even on one thread; ``KVROUTE_CPU_PREPACK=0``:
    the weight as it is. Read when a ``Linear`` is built; the product is F.linear's."""
    g = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(40, 32, generator=g), torch.randn(40, generator=g)
    x = torch.randn(3, 32, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert Linear(weight, bias).form == "tiled"
        monkeypatch.setenv(switch, "0")
        lin = Linear(weight, bias)
    finally:
        torch.set_num_threads(threads)
    assert lin.form in form and (lin.weight is None) == (lin.form != "plain")
    _close(lin(x), F.linear(x, weight, bias))
