"""The CPU layer ops in C against the torch ops they replace (transformers' math, fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from kvroute.kernels import cpu_ops

pytestmark = pytest.mark.skipif(
    not cpu_ops.usable(torch.device("cpu"), torch.float32), reason="C layer ops not built"
)


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + eps))


@pytest.mark.parametrize("cols", [576, 64, 37])  # 37: the scalar tail alone past 32
@pytest.mark.parametrize("add", [True, False])
def test_add_rms_norm(cols: int, add: bool) -> None:
    g = torch.Generator().manual_seed(cols)
    residual = torch.randn(9, cols, generator=g) * 3
    x = torch.randn(9, cols, generator=g) if add else None
    weight = torch.randn(cols, generator=g)
    want_res = residual + x if x is not None else residual.clone()
    want = _hf_rms_norm(want_res, weight, 1e-6)
    got = cpu_ops.add_rms_norm(residual, x, weight, 1e-6)
    torch.testing.assert_close(residual, want_res, atol=0, rtol=0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_add_rms_norm_on_strided_rows() -> None:
    base = torch.randn(4, 100)
    residual = base[:, :64]  # rows of 64 with a stride of 100
    x = torch.randn(4, 64)
    weight = torch.randn(64)
    want = _hf_rms_norm(residual + x, weight, 1e-5)
    got = cpu_ops.add_rms_norm(residual, x, weight, 1e-5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(base[:, 64:], base[:, 64:])  # untouched columns stay


@pytest.mark.parametrize("inter", [1536, 24, 19])
def test_silu_mul(inter: int) -> None:
    g = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(5, 2 * inter, generator=g) * 8
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, -90.0, 90.0])  # past exp's float range
    want = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    got = cpu_ops.silu_mul(gate_up)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128, 40])  # 40: a half of 20, the scalar tail
def test_rotary_in_place_matches_transformers(head_dim: int) -> None:
    g = torch.Generator().manual_seed(head_dim)
    tokens, heads, extra = 6, 5, 3  # the last 3 heads of each row are left alone (V)
    qkv = torch.randn(tokens, (heads + extra) * head_dim, generator=g)
    freqs = torch.randn(tokens, head_dim // 2, generator=g)
    emb = torch.cat((freqs, freqs), dim=-1)  # transformers' layout: cos/sin repeat per half
    cos, sin = emb.cos(), emb.sin()
    x = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    want = qkv.clone()
    want[:, : heads * head_dim] = (x * cos[:, None] + rotated * sin[:, None]).reshape(tokens, -1)
    cpu_ops.rotary_(qkv, cos, sin, heads, head_dim)
    torch.testing.assert_close(qkv, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [128, 64, 40])  # 40: the scalar tail past 32
def test_rms_norm_heads_normalizes_each_head_in_place(head_dim: int) -> None:
    """Qwen3's q and k norms: each head of each token on its own, one weight per head dim;
    the k heads start mid-row (a view), and the V heads after them are left alone."""
    g = torch.Generator().manual_seed(head_dim)
    tokens, hq, hk = 5, 4, 2
    qkv = torch.randn(tokens, (hq + 2 * hk) * head_dim, generator=g) * 4
    wq, wk = torch.randn(head_dim, generator=g), torch.randn(head_dim, generator=g)
    want = qkv.clone()
    q = want[:, : hq * head_dim].view(tokens, hq, head_dim)
    k = want[:, hq * head_dim : (hq + hk) * head_dim].view(tokens, hk, head_dim)
    want[:, : hq * head_dim] = _hf_rms_norm(q, wq, 1e-6).reshape(tokens, -1)
    want[:, hq * head_dim : (hq + hk) * head_dim] = _hf_rms_norm(k, wk, 1e-6).reshape(tokens, -1)
    cpu_ops.rms_norm_heads_(qkv, wq, hq, head_dim, 1e-6)
    cpu_ops.rms_norm_heads_(qkv[:, hq * head_dim :], wk, hk, head_dim, 1e-6)
    torch.testing.assert_close(qkv, want, atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError):
        cpu_ops.add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 9), torch.ones(8), 1e-6)
    with pytest.raises(ValueError):
        cpu_ops.rotary_(torch.zeros(2, 64), torch.zeros(2, 32), torch.zeros(2, 32), 1, 64)
    with pytest.raises(ValueError):
        cpu_ops.rms_norm_heads_(torch.zeros(2, 64), torch.ones(64), 2, 64, 1e-6)
    with pytest.raises(ValueError):
        cpu_ops.rms_norm_heads_(torch.zeros(2, 128), torch.ones(32), 2, 64, 1e-6)


def test_kvroute_cpu_layer_ops_0_turns_them_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read by ``usable`` (once per engine, when its decoder is built)."""
    cpu = torch.device("cpu")
    assert not cpu_ops.usable(cpu, torch.float16)  # fp32 only
    monkeypatch.setenv("KVROUTE_CPU_LAYER_OPS", "0")
    assert not cpu_ops.usable(cpu, torch.float32)
    monkeypatch.setenv("KVROUTE_CPU_LAYER_OPS", "1")
    assert cpu_ops.usable(cpu, torch.float32)
