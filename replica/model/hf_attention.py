"""transformers' own modules on kvroute's paged kernels: the attention function kvroute
registers with transformers, and what it refuses.

transformers' decoders (``model_impl="transformers"``) call a registered attention function
(``AttentionInterface``) with each layer's Q/K/V after rotary embedding. kvroute registers
``"kvroute_paged"``: it writes the step's K/V into the paged cache and attends over it with
:mod:`kvroute.kernels`; the step's metadata and the runner's kernel backend reach it
through a context variable (:data:`FORWARD_CONTEXT`, set by the runner around each
forward), as vLLM's forward context does. Anything it cannot compute exactly -- an
attention argument the kernels do not implement, a mask or bias of the model's own, K/V of
another shape than the cache's -- is raised as :class:`UnsupportedModelError`, which the
runner's load probe turns into a refusal before the replica serves anything
(``ModelRunner._probe_transformers_path``).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from kvroute.kernels import AttentionMetadata, KernelBackend

ATTN_IMPLEMENTATION = "kvroute_paged"


class UnsupportedModelError(ValueError):
    """The engine cannot serve this model exactly; the message names the config field."""


@dataclass(slots=True)
class ForwardContext:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    meta: AttentionMetadata
    kernels: KernelBackend  # the runner's, chosen when it was built
    calls: int = 0  # attention calls this forward (the load probe counts them)


FORWARD_CONTEXT: contextvars.ContextVar[ForwardContext] = contextvars.ContextVar("kvroute_fwd")

# Arguments transformers' modules pass that change nothing here: the kernels are causal,
# see only the step's own tokens, and never drop out at inference.
_BENIGN_ATTENTION_KWARGS = frozenset(
    {
        "position_ids",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "output_attentions",
        "use_cache",
        "cache_position",
        "past_key_values",
        "position_embeddings",
        "layer_idx",
    }
)


def _refuse_unhandled(module: torch.nn.Module, mask: object, kwargs: dict[str, object]) -> None:
    """Raises UnsupportedModelError for an attention call the paged kernels would get wrong."""
    if mask is not None:
        raise UnsupportedModelError(
            f"{type(module).__name__} passes an attention mask or bias of its own "
            "(the paged kernels compute causality themselves)"
        )
    for key, value in kwargs.items():
        if key in _BENIGN_ATTENTION_KWARGS or value is None:
            continue
        if key == "dropout" and not value:
            continue
        if key == "is_causal" and value:
            continue
        raise UnsupportedModelError(
            f"{type(module).__name__} passes attention argument {key}={value!r}, which "
            "kvroute's paged kernels do not implement"
        )


def _paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: Q/K/V are [1, heads, tokens, head_dim]."""
    ctx = FORWARD_CONTEXT.get()
    _refuse_unhandled(module, attention_mask, kwargs)
    ctx.calls += 1
    meta = ctx.meta
    k_cache, v_cache = ctx.kv_caches[module.layer_idx]
    if (
        key.shape[1] != k_cache.shape[2]
        or key.shape[3] != k_cache.shape[3]
        or (value.shape[3] != v_cache.shape[3])
    ):
        raise UnsupportedModelError(
            f"{type(module).__name__} attends with {key.shape[1]} K/V heads of {key.shape[3]} "
            f"(K) and {value.shape[3]} (V) dims, where the config's fields give "
            f"{k_cache.shape[2]} of {k_cache.shape[3]}: its KV layout is not the config's "
            "num_key_value_heads x head_dim (e.g. latent attention)"
        )
    q = query[0].transpose(0, 1)
    kernels = ctx.kernels
    kernels.store_kv(
        key[0].transpose(0, 1), value[0].transpose(0, 1), k_cache, v_cache, meta.slot_mapping
    )
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = kernels.paged_attention(
        q, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window
    )
    return out.unsqueeze(0), None  # [1, tokens, heads, head_dim], no weights


def _no_mask(*args: object, **kwargs: object) -> None:
    """Causality lives in the paged kernel; transformers must not build an N x N mask."""
    return None


# Registered with transformers at import: a model built with attn_implementation="kvroute_paged"
# finds it by name, and this module is imported before any such model is built.
AttentionInterface.register(ATTN_IMPLEMENTATION, _paged_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


# Config fields by which a model's own forward changes the logits after the LM head; the
# runner calls the LM head itself, so such a model would be served wrong: refused.
_LOGIT_FIELDS = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_multiplier_scale",
)


def refuse_logit_processing(config: PretrainedConfig) -> None:
    for name in _LOGIT_FIELDS:
        value = getattr(config, name, None)
        if value is not None and value != 1.0:
            raise UnsupportedModelError(
                f"config {name}={value!r}: the model scales its logits after the LM head, "
                "which kvroute's engine does not do"
            )
