"""PEFT LoRA adapters: what kvroute's engine serves, checked, and read into memory.

An adapter is a folder as PEFT's ``save_pretrained`` writes it: ``adapter_config.json`` and
``adapter_model.safetensors``. kvroute serves plain LoRA on any of a decoder layer's
projections (q/k/v/o, gate/up/down) with one rank, scaled by ``lora_alpha / r`` (or
``lora_alpha / sqrt(r)`` with ``use_rslora``). Anything else PEFT can save changes what the
adapter computes, so it is refused at registration with an error naming the field or the
tensor, never served as something else: DoRA, biases, modules saved whole, per-module ranks
or alphas, trained embedding rows, aLoRA, and the rest listed in :data:`_REFUSED`.

Two stages, so that registering is quick and loading can run off the engine's step:
:func:`inspect_adapter` reads the config and the safetensors header (names, shapes, dtypes)
and checks them against the model; :func:`load_adapter` then reads the tensors. Both run on
a reader thread under a deadline (:mod:`.lora_reads`), never on the engine's.

Read once, checked always: the folder may change between the two (rewritten at another
rank, truncated, swapped), so :func:`load_adapter` checks what it read against what was
registered -- the same tensor names, each of the registered shape and a float dtype -- and
refuses anything else with a :class:`LoRAError` naming the adapter and what changed. A
tensor of another shape must never reach the device slots, where its copy would raise on
the engine's step and take every request of the replica down with it.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "TARGETS",
    "AdapterSpec",
    "LoRAAdapter",
    "LoRAError",
    "ProjectionGroup",
    "inspect_adapter",
    "load_adapter",
]

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# Config fields that change what an adapter computes, which kvroute does not implement:
# each must be absent or empty/false. Value: what the field means, for the error.
_REFUSED: dict[str, str] = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "modules_to_save": "modules trained and saved whole beside the adapter",
    "lora_bias": "a bias on lora_B",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "trainable_token_indices": "trained embedding rows",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
    "velora_config": "VeLoRA",
    "arrow_config": "Arrow routing",
    "target_parameters": "LoRA on parameters rather than modules",
    "layer_replication": "replicated layers",
    "megatron_config": "Megatron-parallel layers",
    "fan_in_fan_out": "Conv1D (transposed) weights",
}
# The dtypes an adapter's tensors may have (safetensors' names, and torch's).
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
_TORCH_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header
MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes
# model.layers.<i>.<self_attn|mlp>.<target>.lora_<A|B>.weight, under any prefix
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    """An adapter kvroute cannot serve exactly; the message names the field or tensor."""


@dataclass(frozen=True, slots=True)
class ProjectionGroup:
    """One (fused) projection of a decoder layer, as the decoder computes it: its input
    width and its targets with their output widths, in the fused output's column order
    (QKV: q, k, v; gate-up: gate, up)."""

    in_features: int
    targets: tuple[tuple[str, int], ...]

    def shapes(self) -> dict[str, tuple[int, int]]:
        return {t: (self.in_features, out) for t, out in self.targets}


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """What :func:`inspect_adapter` found: enough to load it and to size device slots."""

    path: str
    rank: int
    scaling: float
    # (layer, target) -> safetensors names of its A and B
    tensors: dict[tuple[int, str], tuple[str, str]] = field(repr=False)
    # safetensors name -> its shape as registered: A [rank, in], B [out, rank]
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)

    @property
    def targets(self) -> frozenset[str]:
        return frozenset(t for _, t in self.tensors)


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter in host memory, in the kernels' layout (:mod:`kvroute.kernels.lora`):
    per (layer, target) ``A.T`` [in, r] and ``B.T * scaling`` [r, out], in the model's
    dtype (the scaling folded into B once, as vLLM does)."""

    name: str
    spec: AdapterSpec
    weights: dict[tuple[int, str], tuple[Tensor, Tensor]] = field(repr=False)

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_regular(file: Path, limit: int | None = None) -> bytes:
    """The bytes of ``file`` (its first ``limit``), which must be a regular file. Opened
    without blocking, so a FIFO or a device where a file should be is refused at once
    rather than waited on forever."""
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LoRAError(f"{file}: not a regular file (a FIFO, socket or device)")
        return f.read() if limit is None else f.read(limit)


def _config(folder: Path) -> dict[str, Any]:
    file = folder / CONFIG_FILE
    try:
        raw = read_regular(file, MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise LoRAError(f"{file}: larger than {MAX_CONFIG_BYTES} bytes")
        cfg = json.loads(raw)
    except LoRAError:
        raise
    except FileNotFoundError:
        raise LoRAError(f"{folder}: no {CONFIG_FILE} (not a PEFT adapter folder)") from None
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{file}: cannot be read as JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{file}: not a JSON object")
    return cfg


def _check_config(cfg: dict[str, Any], file: str, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a plain LoRA config; LoRAError naming the first field that is not."""
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError(f"{file}: peft_type={peft_type!r}; only LORA adapters are served")
    for name, what in _REFUSED.items():
        if cfg.get(name):
            raise LoRAError(f"{file}: {name}={cfg[name]!r} ({what}) is not supported")
    bias = cfg.get("bias", "none")
    if bias != "none":
        raise LoRAError(f"{file}: bias={bias!r} is not supported (only 'none')")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAError(f"{file}: r={r!r} must be a positive integer")
    if r > max_rank:
        raise LoRAError(f"{file}: r={r} exceeds max_lora_rank={max_rank}")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAError(f"{file}: lora_alpha={alpha!r} must be a number")
    rslora = cfg.get("use_rslora", False)
    return r, float(alpha) / (math.sqrt(r) if rslora else r)


def _header(file: Path) -> dict[str, tuple[str, list[int]]]:
    """A safetensors file's tensors from its header alone: name -> (dtype, shape)."""
    head = read_regular(file, 8)
    if len(head) < 8:
        raise LoRAError(f"{file}: cannot be read as safetensors (shorter than its header)")
    (n,) = struct.unpack("<Q", head)
    size = os.stat(file).st_size
    if n > min(MAX_HEADER_BYTES, size - 8):
        raise LoRAError(f"{file}: cannot be read as safetensors (header of {n} bytes)")
    try:
        raw = json.loads(read_regular(file, 8 + n)[8:])
        out: dict[str, tuple[str, list[int]]] = {}
        for key, entry in raw.items():
            if key == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            if not 0 <= begin <= end <= size - 8 - n:
                raise ValueError(f"tensor {key!r} lies past the end of the file")
            out[key] = (str(entry["dtype"]), [int(d) for d in entry["shape"]])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LoRAError(f"{file}: cannot be read as safetensors ({exc})") from None
    return out


def inspect_adapter(
    path: str | Path, shapes: dict[str, tuple[int, int]], num_layers: int, max_rank: int
) -> AdapterSpec:
    """Checks a PEFT adapter folder against the model without reading its weights.

    ``shapes``: target -> (in_features, out_features) of the model's projections. Raises
    LoRAError naming the config field or tensor kvroute cannot serve exactly."""
    folder = Path(path)
    rank, scaling = _check_config(_config(folder), str(folder / CONFIG_FILE), max_rank)
    file = folder / WEIGHTS_FILE
    try:
        header = _header(file)
    except FileNotFoundError:
        raise LoRAError(f"{folder}: no {WEIGHTS_FILE} (adapter_model.bin is not read)") from None
    except OSError as exc:
        raise LoRAError(f"{file}: cannot be read ({exc})") from None
    found: dict[tuple[int, str], dict[str, str]] = {}
    want_shapes: dict[str, tuple[int, int]] = {}
    for key, (dtype, got) in header.items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAError(f"{file}: tensor {key!r} is not LoRA A/B of a decoder layer")
        layer, target, ab = int(m.group(1)), m.group(2), m.group(3)
        if target not in shapes:
            served = ", ".join(shapes)
            raise LoRAError(f"{file}: tensor {key!r} targets {target} (served: {served})")
        if layer >= num_layers:
            raise LoRAError(f"{file}: tensor {key!r}: the model has {num_layers} layers")
        fan_in, fan_out = shapes[target]
        want = (rank, fan_in) if ab == "A" else (fan_out, rank)
        if tuple(got) != want:
            raise LoRAError(f"{file}: tensor {key!r} has shape {got}, expected {list(want)}")
        if dtype not in FLOAT_DTYPES:
            raise LoRAError(f"{file}: tensor {key!r} is {dtype}, not a float type")
        found.setdefault((layer, target), {})[ab] = key
        want_shapes[key] = want
    tensors: dict[tuple[int, str], tuple[str, str]] = {}
    for (layer, target), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"{file}: layer {layer} {target} has lora_{''.join(pair)} only")
        tensors[(layer, target)] = (pair["A"], pair["B"])
    if not tensors:
        raise LoRAError(f"{file}: no LoRA tensors")
    return AdapterSpec(
        path=str(folder), rank=rank, scaling=scaling, tensors=tensors, shapes=want_shapes
    )


def load_adapter(name: str, spec: AdapterSpec, dtype: torch.dtype) -> LoRAAdapter:
    """Reads an inspected adapter's tensors into host memory, in the kernels' layout, after
    checking them against what was registered (the module docstring): LoRAError naming the
    adapter and what changed, for a file rewritten since or one that cannot be read."""
    from safetensors.torch import load

    file = Path(spec.path) / WEIGHTS_FILE
    changed = f"LoRA adapter {name!r} changed on disk since it was registered"
    try:
        tensors = load(read_regular(file))
    except Exception as exc:  # gone, truncated, not safetensors, a FIFO: this adapter's alone
        why = str(exc) if isinstance(exc, LoRAError) else f"{type(exc).__name__}: {exc}"
        raise LoRAError(f"LoRA adapter {name!r} cannot be read: {why}") from None
    if spec.shapes and tensors.keys() != spec.shapes.keys():
        extra = sorted(tensors.keys() - spec.shapes.keys())
        missing = sorted(spec.shapes.keys() - tensors.keys())
        what = f"tensor {extra[0]!r} is new" if extra else f"tensor {missing[0]!r} is gone"
        raise LoRAError(f"{changed}: {what}")
    for key, want in spec.shapes.items():
        t = tensors[key]
        if tuple(t.shape) != want:
            raise LoRAError(
                f"{changed}: tensor {key!r} has shape {list(t.shape)}, registered {list(want)}"
            )
        if t.dtype not in _TORCH_FLOATS:
            raise LoRAError(f"{changed}: tensor {key!r} is {t.dtype}, not a float type")
    weights: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
    for key, (a_name, b_name) in spec.tensors.items():
        if a_name not in tensors or b_name not in tensors:
            raise LoRAError(f"{changed}: tensor {a_name!r} or {b_name!r} is gone")
        a = tensors[a_name].to(torch.float32)
        b = tensors[b_name].to(torch.float32) * spec.scaling
        weights[key] = (a.t().to(dtype).contiguous(), b.t().to(dtype).contiguous())
    return LoRAAdapter(name=name, spec=spec, weights=weights)
