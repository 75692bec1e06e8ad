"""``kvroute serve``'s LoRA flags, vLLM's names and forms: ``--enable-lora``,
``--max-loras``, ``--max-cpu-loras``, ``--max-lora-rank``, ``--lora-modules``.

Why a module of its own: the flags' forms (``name=path``, or vLLM's JSON object with
``name``, ``path`` and ``base_model_name``) are parsed and checked here, once, before Ray
starts, so a typo costs one line and not a fleet started for nothing; :mod:`.serve` only
adds what :func:`lora_settings` returns to every replica's engine config.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Collection
from typing import Any

from kvroute.router.fleet.names import CONTROL_CHARS


class LoRAFlagError(ValueError):
    """A LoRA flag kvroute cannot serve (the message names the flag)."""


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters (docs/lora.md)")
    g.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (implied by --lora-modules): a request names one in `model`",
    )
    g.add_argument(
        "--max-loras",
        type=int,
        default=None,
        help="adapters held in device slots at once: one engine step mixes at most this "
        "many (default: 1, as vLLM)",
    )
    g.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept in host memory (least recently used out first; default: --max-loras)",
    )
    g.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        help="the largest adapter rank accepted (default: 16, as vLLM)",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="adapters to serve from the start: name=path (a PEFT folder), or vLLM's JSON "
        '\'{"name": "a", "path": "/x", "base_model_name": "..."}\'',
    )


def parse_lora_module(text: str, base_models: Collection[str] = ()) -> tuple[str, str]:
    """One ``--lora-modules`` item as (name, path). ``base_models``: the served model's
    names (a JSON item's ``base_model_name`` must be one: kvroute serves one base model)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            item = json.loads(text)
        except json.JSONDecodeError as exc:
            raise LoRAFlagError(f"--lora-modules {text[:80]!r}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise LoRAFlagError(f"--lora-modules {text[:80]!r}: expected a JSON object")
        unknown = set(item) - {"name", "path", "base_model_name"}
        if unknown:
            raise LoRAFlagError(
                f"--lora-modules {text[:80]!r}: unknown key(s) {', '.join(sorted(unknown))}"
            )
        name, path = item.get("name"), item.get("path")
        base = item.get("base_model_name")
        if base is not None and base_models and base not in base_models:
            raise LoRAFlagError(
                f"--lora-modules {text[:80]!r}: base_model_name {base!r} is not the model "
                f"served ({' or '.join(map(repr, base_models))})"
            )
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise LoRAFlagError(f"--lora-modules {text[:80]!r}: expected NAME=PATH or JSON")
    if not isinstance(name, str) or not name.strip():
        raise LoRAFlagError(f"--lora-modules {text[:80]!r}: the name is empty")
    if not isinstance(path, str) or not path.strip():
        raise LoRAFlagError(f"--lora-modules {text[:80]!r}: the path is empty")
    if CONTROL_CHARS.search(
        name.strip()
    ):  # it becomes a /metrics label (kvroute.router.fleet.names)
        raise LoRAFlagError(f"--lora-modules {text[:80]!r}: the name holds a control character")
    return name.strip(), path.strip()


def lora_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The engine-config keys the flags set: kvroute's EngineConfig fields, or for
    ``--engine vllm`` the adapters and vLLM's own engine arguments (its CPU build serves
    LoRA too); empty when LoRA is off. Raises :class:`LoRAFlagError`."""
    items = args.lora_modules or []
    tuning = {
        "max_loras": args.max_loras,
        "max_cpu_loras": args.max_cpu_loras,
        "max_lora_rank": args.max_lora_rank,
    }
    if not args.enable_lora and not items:
        given = [k for k, v in tuning.items() if v is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise LoRAFlagError(f"{flag} needs --enable-lora or --lora-modules")
        return {}
    modules: dict[str, str] = {}
    for text in items:
        bases = [b for b in (args.model, getattr(args, "served_model_name", None)) if b]
        name, path = parse_lora_module(text, bases)
        if name in modules and modules[name] != path:
            raise LoRAFlagError(f"--lora-modules: {name!r} is given twice")
        modules[name] = path
    for key, value in tuning.items():
        if value is not None and value < 1:
            raise LoRAFlagError(f"--{key.replace('_', '-')} must be >= 1, got {value}")
    max_loras = tuning["max_loras"] or 1
    if tuning["max_cpu_loras"] is not None and tuning["max_cpu_loras"] < max_loras:
        raise LoRAFlagError(
            f"--max-cpu-loras ({tuning['max_cpu_loras']}) must be >= --max-loras ({max_loras})"
        )
    given = {k: v for k, v in tuning.items() if v is not None}
    if getattr(args, "engine", "kvroute") == "vllm":  # vLLM's own engine arguments
        return {"lora_modules": modules, "engine_args": {"enable_lora": True, **given}}
    return {"enable_lora": True, "lora_modules": modules, **given}
