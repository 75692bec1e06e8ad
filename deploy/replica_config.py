"""Each replica's settings from ``kvroute serve``'s flags: the engine config handed to every
replica actor (:func:`engine_config`) and the prefill/decode roles (:func:`pd_roles`).

Why a module of its own: turning flags into an engine config is pure (no Ray, no
processes, no network), so tests and other commands read it without the startup code of
:mod:`.serve`, and ``serve.py`` keeps to starting and stopping the fleet. :mod:`.serve`
imports both (as ``engine_config`` and ``_pd_roles``, the names tests import from it).
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from .startup_cause import StartupError

__all__ = ["engine_config", "pd_roles"]


def pd_roles(args: argparse.Namespace) -> str | None:
    """``--prefill-replicas``/``--decode-replicas``: each replica's role (``args.roles``,
    prefill ones first) and their total in ``args.replicas``; or why the flags are wrong."""
    p, d = getattr(args, "prefill_replicas", 0) or 0, getattr(args, "decode_replicas", 0) or 0
    args.roles = None
    if not (p or d):
        return None
    if p < 1 or d < 1:
        return "--prefill-replicas and --decode-replicas go together, each >= 1"
    if args.engine == "vllm" and importlib.util.find_spec("nixl") is None:
        # vLLM's replicas move KV with its NixlConnector (replica/vllm/disagg.py)
        return "--engine vllm with --prefill-replicas/--decode-replicas needs `pip install nixl`"
    if args.max_replicas is not None:
        return "--prefill-replicas/--decode-replicas do not autoscale yet: drop --max-replicas"
    if args.model.startswith("sim:"):
        return "--prefill-replicas/--decode-replicas need a model (KV moves between them)"
    both = args.replicas or 0
    args.roles = ["prefill"] * p + ["decode"] * d + ["both"] * both
    args.replicas = p + d + both
    return None


def engine_config(args: argparse.Namespace) -> dict[str, Any]:
    """Each replica's engine config from ``kvroute serve``'s flags (its own engine's
    ``EngineConfig`` fields, or a vLLM replica's keys with vLLM's engine arguments)."""
    config: dict[str, Any] = {"model": args.model, "block_size": args.block_size}
    if args.dtype:
        config["dtype"] = args.dtype
    if args.max_model_len:
        config["max_model_len"] = args.max_model_len
    if args.engine == "vllm":
        config.update(_vllm_settings(args))
        lora = dict(getattr(args, "lora", None) or {})
        if lora:  # vLLM's LoRA arguments beside --vllm-args (which win)
            config["engine_args"] = {**lora.pop("engine_args"), **config.get("engine_args", {})}
            config.update(lora)
    else:
        if args.time_scale != 1.0:
            config["time_scale"] = args.time_scale
        if args.num_blocks:
            config["num_blocks"] = args.num_blocks
        if args.model_impl != "auto":
            config["model_impl"] = args.model_impl
        if args.enforce_eager:
            config["enforce_eager"] = True
        if args.long_prefill_token_threshold:
            config["long_prefill_token_threshold"] = args.long_prefill_token_threshold
        if args.max_num_partial_prefills:
            config["max_num_partial_prefills"] = args.max_num_partial_prefills
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(args, name, None):
                config[name] = getattr(args, name)
        if args.kv_host_bytes:
            config["kv_host_bytes"] = args.kv_host_bytes
        if args.kv_disk_path or args.kv_disk_bytes:
            if not (args.kv_disk_path and args.kv_disk_bytes):
                raise StartupError("--kv-disk-path and --kv-disk-bytes go together")
            config["kv_disk_bytes"] = args.kv_disk_bytes
            if getattr(args, "kv_disk_encrypt", False):
                config["kv_disk_encrypt"] = True
        config.update(getattr(args, "lora", None) or {})
        if getattr(args, "prefix_fetch", False) or getattr(args, "pd_split", "") == "pair":
            config["kv_transfer"] = True  # each replica serves and pulls KV (fetch, pairs)
        if getattr(args, "kv_link_gbps", None):  # checked > 0 before anything started
            config["kv_link_bytes_per_s"] = args.kv_link_gbps * 1e9
    return config


def _vllm_settings(args: argparse.Namespace) -> dict[str, Any]:
    """A vLLM replica's config keys (replica/vllm/adapt.py): kvroute's flags that vLLM has
    under its own names go into its engine arguments."""
    settings: dict[str, Any] = {"engine": "vllm"}
    if args.num_blocks:
        settings["num_blocks"] = args.num_blocks
    extra = dict(args.vllm_args or {})
    if args.long_prefill_token_threshold:
        extra.setdefault("long_prefill_token_threshold", args.long_prefill_token_threshold)
    if args.max_num_partial_prefills:
        extra.setdefault("max_num_partial_prefills", args.max_num_partial_prefills)
    if args.enforce_eager:
        extra.setdefault("enforce_eager", True)
    for name in ("max_num_batched_tokens", "max_num_seqs"):
        if getattr(args, name, None):
            extra.setdefault(name, getattr(args, name))
    if extra:
        settings["engine_args"] = extra
    return settings
