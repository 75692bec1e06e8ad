"""kvroute's own decoder for the Llama family: Llama, Mistral, Qwen2, Qwen3 and Gemma3.

Why own code: transformers' modules cost a step seven projection GEMMs per layer (q, k, v,
o, gate, up, down), rotary embedding applied to q and k apart, RMSNorm as five ops, and a
Python call chain per module; on a small batch that overhead is the step. Here each layer
is two fused projections in (QKV, gate-up) and two out, rotary applied once to q and k
side by side, and attention called on the paged cache directly (:mod:`kvroute.kernels`).

transformers stays the loader and the reference: the weights are those of the loaded
``*ForCausalLM`` (QKV and gate-up concatenated once at load, the originals then freed),
the embedding, the final norm, the LM head and the rotary embedding module (every rope
type it knows) are its own modules, reused as they are.

Families share one layer with switches read from the config: attention and MLP biases
(Qwen2's QKV bias, Llama's ``attention_bias``/``mlp_bias``), per-head q/k norms (Qwen3,
Gemma3), and the sliding window per layer (Mistral: every layer; Qwen2/Qwen3/Gemma3: the
layers that ``layer_types`` marks ``sliding_attention``). Gemma3 adds four more: norms
around both sublayers' outputs as well as before them ("sandwich" norms), RMSNorm weights
stored as an offset from 1 (added once at load), a tanh-GELU gate, and a rotary table per
layer type (local layers' base differs from global ones'); its embedding module scales by
sqrt(hidden) itself and its attention scale is ``query_pre_attn_scalar ** -0.5``. Anything
else is not this module's: :func:`unsupported` says why, and the runner uses
transformers' modules instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from kvroute.kernels import AttentionMetadata, KernelBackend, cpu_ops, select_backend

from .linear import Linear
from .lora_adapter import ProjectionGroup

if TYPE_CHECKING:
    from .lora_store import LoRAStep

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
SANDWICH = ("gemma3_text",)  # norms after each sublayer too, weights as offsets from 1


def unsupported(config: object) -> str | None:
    """Why this module cannot run ``config`` exactly (None: it can)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        return f"model_type {model_type!r} is not one of {', '.join(FAMILIES)}"
    if model_type in SANDWICH:
        act = getattr(config, "hidden_activation", None)
        if act != "gelu_pytorch_tanh":
            return f"hidden_activation {act!r} (Gemma's gate here is tanh-GELU)"
        for field in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(config, field, None) is not None:
                return f"{field} (logit soft-capping is not implemented)"
        if getattr(config, "use_bidirectional_attention", False):
            return "use_bidirectional_attention (the kernels are causal)"
    else:
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            return f"hidden_act {act!r} (the fused MLP is SwiGLU)"
    types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in types} - {"full_attention", "sliding_attention"})
    if other:
        return f"layer_types {other}"
    return None


def layer_windows(config: object) -> list[int | None]:
    """Each layer's sliding window, as transformers' attention modules read it."""
    n = config.num_hidden_layers  # type: ignore[attr-defined]
    window = getattr(config, "sliding_window", None)
    if config.model_type == "mistral":  # type: ignore[attr-defined]
        return [window] * n  # MistralAttention passes config.sliding_window on every layer
    types = getattr(config, "layer_types", None) or ["full_attention"] * n
    return [window if t == "sliding_attention" else None for t in types]


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """torch's fused RMSNorm: one kernel, not transformers' five. The same math in fp32;
    in bf16 it rounds once where transformers rounds twice (as vLLM's own kernel does)."""
    return F.rms_norm(x, weight.shape, weight, eps)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """transformers' apply_rotary_pos_emb (half-split rotation) on [T, heads, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _cat_linear(layers: list[nn.Linear]) -> Linear:
    """One projection for several that read the same input (q, k, v; gate, up)."""
    weight = torch.cat([lin.weight.detach() for lin in layers])
    biases = [lin.bias for lin in layers]
    if all(b is None for b in biases):
        return Linear(weight)
    bias = torch.cat(
        [
            b.detach() if b is not None else weight.new_zeros(lin.out_features)
            for b, lin in zip(biases, layers, strict=True)
        ]
    )
    return Linear(weight, bias)


@dataclass(slots=True)
class _Layer:
    input_norm: Tensor
    post_norm: Tensor  # before the MLP (transformers' post_attention_layernorm, Llama-style)
    attn_out_norm: Tensor | None  # Gemma3: on the attention's output, before the residual
    mlp_out_norm: Tensor | None  # Gemma3: on the MLP's output, before the residual
    rope: str | None  # which rotary table (Gemma3: the layer type; else the one)
    qkv: Linear
    q_norm: Tensor | None
    k_norm: Tensor | None
    o: Linear
    gate_up: Linear
    down: Linear
    window: int | None


class PagedDecoder:
    """The decoder stack of a Llama-family ``*ForCausalLM``, over kvroute's paged cache.

    Built from a loaded transformers model, whose decoder layers it empties (their weights
    now live here, fused); the embedding, final norm and rotary module stay shared.
    """

    def __init__(self, model: nn.Module, kernels: KernelBackend | None = None) -> None:
        why = unsupported(model.config)
        if why is not None:
            raise ValueError(f"PagedDecoder cannot run this model: {why}")
        cfg = model.config
        base = model.get_decoder()
        sandwich = cfg.model_type in SANDWICH
        # Gemma's norms scale by 1 + weight, computed in fp32 by transformers; here added
        # once at load in the weights' dtype (in bf16 one rounding more, as the fused
        # norm's single rounding saves one elsewhere)
        offset = 1.0 if sandwich else 0.0

        def norm_weight(module: nn.Module) -> Tensor:
            w = module.weight.detach()
            return w + offset if offset else w

        self.embed = base.embed_tokens  # Gemma3's scales by sqrt(hidden) itself
        self.final_norm_weight = norm_weight(base.norm)
        self.rotary = base.rotary_emb
        self.eps = float(cfg.rms_norm_eps)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.scale = (cfg.query_pre_attn_scalar if sandwich else self.head_dim) ** -0.5
        self.gelu = sandwich  # tanh-GELU gate (Gemma), else SiLU
        windows = layer_windows(cfg)
        types = getattr(cfg, "layer_types", None) or ["full_attention"] * len(base.layers)
        weight = self.embed.weight
        # On a CPU in fp32: norms, rotary and SiLU-times-up in C (kernels/cpu_ops.py).
        self.c_ops = cpu_ops.usable(weight.device, weight.dtype)
        # store_kv and paged attention: the runner's backend, else chosen here, once.
        self.kernels = kernels if kernels is not None else select_backend(weight.device)
        self.layers: list[_Layer] = []
        self.intermediate_size = base.layers[0].mlp.gate_proj.out_features if base.layers else 0
        for i in range(len(base.layers)):
            layer = base.layers[i]
            attn, mlp = layer.self_attn, layer.mlp
            q_norm = getattr(attn, "q_norm", None)
            k_norm = getattr(attn, "k_norm", None)
            self.layers.append(
                _Layer(
                    input_norm=norm_weight(layer.input_layernorm),
                    post_norm=norm_weight(
                        layer.pre_feedforward_layernorm
                        if sandwich
                        else layer.post_attention_layernorm
                    ),
                    attn_out_norm=(
                        norm_weight(layer.post_attention_layernorm) if sandwich else None
                    ),
                    mlp_out_norm=(
                        norm_weight(layer.post_feedforward_layernorm) if sandwich else None
                    ),
                    rope=types[i] if sandwich else None,
                    qkv=_cat_linear([attn.q_proj, attn.k_proj, attn.v_proj]),
                    q_norm=norm_weight(q_norm) if q_norm is not None else None,
                    k_norm=norm_weight(k_norm) if k_norm is not None else None,
                    o=Linear(attn.o_proj.weight, attn.o_proj.bias),
                    gate_up=_cat_linear([mlp.gate_proj, mlp.up_proj]),
                    down=Linear(mlp.down_proj.weight, mlp.down_proj.bias),
                    window=windows[i],
                )
            )
            # This layer's unfused copies go now, not after the last layer: the fused
            # weights never cost more than one layer's worth of extra memory.
            base.layers[i] = nn.Identity()
            del layer, attn, mlp
        base.layers = nn.ModuleList()
        # the rotary tables a step computes, once each (Gemma3: one per layer type)
        self.rope_tables = list(dict.fromkeys(layer.rope for layer in self.layers))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def projection_groups(self) -> list[ProjectionGroup]:
        """Each layer's projections as :meth:`forward` computes them (fused QKV, o, fused
        gate-up, down), in that order: what a :class:`LoRAStep` adds to."""
        hidden = int(self.embed.weight.shape[1])
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        inter = self.intermediate_size
        return [
            ProjectionGroup(hidden, (("q_proj", q), ("k_proj", kv), ("v_proj", kv))),
            ProjectionGroup(q, (("o_proj", hidden),)),
            ProjectionGroup(hidden, (("gate_proj", inter), ("up_proj", inter))),
            ProjectionGroup(inter, (("down_proj", hidden),)),
        ]

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[tuple[Tensor, Tensor]],
        meta: AttentionMetadata,
        lora: LoRAStep | None = None,
    ) -> Tensor:
        """Hidden states [T, hidden] after the final norm, for a flattened varlen batch.
        ``lora``: the step's adapters, added to each projection's output (None: none)."""
        hidden = self.embed(input_ids)
        ropes: dict[str | None, tuple[Tensor, Tensor]] = {}
        for rope in self.rope_tables:
            args = (positions[None],) if rope is None else (positions[None], rope)
            cos, sin = self.rotary(hidden, *args)
            ropes[rope] = (cos[0], sin[0])  # [T, D]
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        kernels = self.kernels
        residual = hidden
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            cos, sin = ropes[layer.rope]
            x = self._add_norm(residual, hidden if i else None, layer.input_norm)
            qkv = layer.qkv(x)
            if lora is not None:  # before q/k norms and rotary, as PEFT's q/k/v_proj
                lora.add(i, 0, x, qkv)
            t = qkv.shape[0]
            v = qkv[:, (h + hk) * d :].view(t, hk, d)
            if self.c_ops:  # in place, q and k side by side in the QKV rows
                if layer.q_norm is not None:  # Qwen3, Gemma3: per head, before rotary
                    cpu_ops.rms_norm_heads_(qkv, layer.q_norm, h, d, self.eps)
                    cpu_ops.rms_norm_heads_(qkv[:, h * d :], layer.k_norm, hk, d, self.eps)  # type: ignore[arg-type]
                cpu_ops.rotary_(qkv, cos, sin, h + hk, d)
                qk = qkv[:, : (h + hk) * d].view(t, h + hk, d)
            elif layer.q_norm is not None:
                q = _rms_norm(qkv[:, : h * d].view(t, h, d), layer.q_norm, self.eps)
                k = _rms_norm(qkv[:, h * d : (h + hk) * d].view(t, hk, d), layer.k_norm, self.eps)  # type: ignore[arg-type]
                qk = _rotate(torch.cat((q, k), dim=1), cos[:, None], sin[:, None])
            else:
                qk = _rotate(qkv[:, : (h + hk) * d].view(t, h + hk, d), cos[:, None], sin[:, None])
            q, k = qk[:, :h], qk[:, h:]
            kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            o = kernels.paged_attention(
                q, k_cache, v_cache, meta, scale=self.scale, sliding_window=layer.window
            )
            o = o.view(t, h * d)
            hidden = layer.o(o)
            if lora is not None:
                lora.add(i, 1, o, hidden)
            if layer.attn_out_norm is not None:
                hidden = self._add_norm(hidden, None, layer.attn_out_norm)
            x = self._add_norm(residual, hidden, layer.post_norm)
            gate_up = layer.gate_up(x)
            if lora is not None:
                lora.add(i, 2, x, gate_up)
            inter = gate_up.shape[1] // 2
            if self.gelu:
                act = F.gelu(gate_up[:, :inter], approximate="tanh") * gate_up[:, inter:]
            elif self.c_ops:
                act = cpu_ops.silu_mul(gate_up)
            else:
                act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            hidden = layer.down(act)
            if lora is not None:
                lora.add(i, 3, act, hidden)
            if layer.mlp_out_norm is not None:
                hidden = self._add_norm(hidden, None, layer.mlp_out_norm)
        return self._add_norm(residual, hidden, self.final_norm_weight)

    def _add_norm(self, residual: Tensor, added: Tensor | None, weight: Tensor) -> Tensor:
        """``residual += added`` in place, then RMSNorm of it (transformers' layers add the
        residual and normalize in this order); ``added`` None: the norm alone, nothing
        changed in place."""
        if self.c_ops:
            return cpu_ops.add_rms_norm(residual, added, weight, self.eps)
        if added is not None:
            residual.add_(added)
        return _rms_norm(residual, weight, self.eps)

    __call__ = forward
