"""Rotary embeddings whose frequencies depend on the sequence's length, computed per sequence.

Why: transformers' ``longrope`` rotary (Phi-3's 128k models, Phi-3.5, Phi-4-mini) takes its
long factors when the longest position of the call passes the pre-training length, else its
short ones; ``dynamic`` (NTK) rescales past it and keeps the result as module state. Both
read ``max(position_ids) + 1`` of the whole call. kvroute runs the step's sequences as one
flattened call, so one long prompt switched every short sequence batched with it to the
long frequencies: a 5-token prompt beside a 100-token one got other greedy tokens than
alone (found by probing every architecture transformers ships; now a test in
tests/replica/test_model_families.py).

How: the model's rotary module is wrapped. Each step the runner says, per sequence, where
its new tokens start, how many there are and how long its prompt is
(:meth:`PerSequenceRotary.step`). A token at position ``p`` gets the frequencies
transformers gives it in ``generate``, which computes it in one call of length ``L(p) =
max(prompt, p + 1)``: the whole prompt in the prefill, each output token in its own decode
step. The wrapper calls the module once per run of adjacent tokens in the same regime (up
to the pre-training length: one regime; longrope past it: one; dynamic past it: one per
length), with one position more, ``L - 1``, appended and its output dropped, so the
module's own ``max(position_ids) + 1`` is that ``L``; its state is reset to the original
frequencies before each call. So a prompt chunked over several steps, a preempted request's
recompute and a decode batch mixing short and long sequences all get transformers' own
frequencies. Static rotary types (default, linear, llama3, yarn) are not wrapped. Models
with such rotary run eager on CUDA (no decode graphs: the calls depend on the step).

The Phi-3 family (``RECOMPUTE_AT_SWITCH``) differs: transformers drops the cache where a
sequence crosses the switch and computes it again, so there every token of a step takes
``L = `` the sequence's whole length, and the engine recomputes a request that crosses
(``LLMEngine.switch_recompute_at``), then salts it long.

Cached prefixes: one computed for a prompt in the other regime (a short prompt's blocks
reused by a long one, or the reverse) holds keys of that regime, where transformers
recomputes them; so a longrope model's prompts past the switch are hashed with
their own salt (:func:`kvroute.events.hashing.regime_salt`, by the engine and by routers,
which learn the switch from the replica's ``ReplicaInfo.long_prompt_after``), and the two
regimes' blocks never meet. (``dynamic`` switches past the model's maximum length, which
the engine never serves, so it needs no salt.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = ["PerSequenceRotary", "length_dependent_rope"]

_KINDS = ("dynamic", "longrope")
# model_types whose transformers class recomputes its whole cache at the switch
# (``prepare_inputs_for_generation`` of Phi3ForCausalLM and PhimoeForCausalLM, 5.19)
RECOMPUTE_AT_SWITCH = frozenset({"phi3", "phimoe"})


def _rope_types(config: object) -> set[str]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return set()
    if "rope_type" in params or "type" in params:
        return {str(params.get("rope_type", params.get("type")))}
    return {
        str(p.get("rope_type", p.get("type"))) for p in params.values() if isinstance(p, dict)
    }  # per layer type (Gemma3)


def length_dependent_rope(config: object) -> str | None:
    """The config's rotary type whose frequencies follow the sequence's length, if any."""
    return next((t for t in sorted(_rope_types(config)) if any(k in t for k in _KINDS)), None)


def _threshold(config: object, rotary: nn.Module, longrope: bool) -> int | None:
    """The longest call that still gets the original frequencies: longrope's
    ``original_max_position_embeddings`` (transformers reads it from the rotary
    parameters), dynamic's ``original_max_seq_len`` (its module's); None: not found, so
    no two lengths share a call and no prompt shares another's blocks."""
    if not longrope:
        value = getattr(rotary, "original_max_seq_len", None)
        return int(value) if value else None
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):  # what transformers' longrope reads, per layer type if so
        if params.get("original_max_position_embeddings"):
            return int(params["original_max_position_embeddings"])
        found = [
            int(p["original_max_position_embeddings"])
            for p in params.values()
            if isinstance(p, dict) and p.get("original_max_position_embeddings")
        ]
        if found:
            return min(found)
    value = getattr(config, "original_max_position_embeddings", None)
    return int(value) if value else None


class PerSequenceRotary(nn.Module):
    """Calls ``rotary`` per sequence regime of the step (module docstring); outside a step
    (no :meth:`step` call), one call over everything, after the same reset."""

    def __init__(self, rotary: nn.Module, config: object) -> None:
        super().__init__()
        self.rotary = rotary
        self.longrope = length_dependent_rope(config) == "longrope"
        # transformers' Phi-3 family drops its cache where a sequence crosses the switch and
        # recomputes it with the long factors: every token of a sequence then takes the
        # regime of the sequence's whole length, and the engine recomputes a sequence that
        # crosses (LLMEngine.switch_recompute_at)
        self.whole_sequence = getattr(config, "model_type", None) in RECOMPUTE_AT_SWITCH
        self.threshold = _threshold(config, rotary, self.longrope)
        # the prefix of each original frequency buffer: "", or per layer type "<type>_"
        self._originals = [
            name[: -len("original_inv_freq")]
            for name, _ in rotary.named_buffers(recurse=False)
            if name.endswith("original_inv_freq")
        ]
        self._runs: list[tuple[int, int]] | None = None  # (tokens, call length) per run

    def _key(self, length: int) -> int:
        if self.threshold is not None and length <= self.threshold:
            return 0
        if self.longrope and self.threshold is not None:
            return 1
        return length + 1  # dynamic past the threshold: its own frequencies

    def step(self, spans: Sequence[tuple[int, int, int, int]]) -> None:
        """This step's sequences, in token order: (first new position, new tokens, prompt
        tokens, all its tokens so far) of each."""
        runs: list[list[int]] = []  # [tokens, key, length for the call]
        for start, n, prompt, total in spans:
            end = start + n
            if self.whole_sequence:  # Phi-3: the regime of the sequence's whole length
                pieces = [(n, max(prompt, total))]
            else:  # prompt tokens as in one call of the whole prompt, outputs at their own
                pieces = [(min(end, prompt) - start, prompt)] if start < prompt else []
                pieces += [(1, p + 1) for p in range(max(start, prompt), end)]
            for count, length in pieces:
                key = self._key(length)
                if runs and runs[-1][1] == key:
                    runs[-1][0] += count
                    runs[-1][2] = max(runs[-1][2], length)
                else:
                    runs.append([count, key, length])
        self._runs = [(count, length) for count, _, length in runs]

    def done(self) -> None:
        self._runs = None

    def _reset(self) -> None:
        rotary = self.rotary
        for prefix in self._originals:
            original = getattr(rotary, f"{prefix}original_inv_freq")
            rotary.register_buffer(f"{prefix}inv_freq", original, persistent=False)
            if hasattr(rotary, "original_max_seq_len"):
                if prefix and hasattr(rotary, f"{prefix}max_seq_len_cached"):
                    setattr(rotary, f"{prefix}max_seq_len_cached", rotary.original_max_seq_len)
                if hasattr(rotary, "max_seq_len_cached"):
                    rotary.max_seq_len_cached = rotary.original_max_seq_len

    def forward(
        self, x: Tensor, position_ids: Tensor, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        runs = self._runs
        if runs is None:  # outside a step (the load probe): the module as it is
            self._reset()
            return self.rotary(x, position_ids, *args, **kwargs)
        cos, sin, start = [], [], 0
        for n, length in runs:
            self._reset()
            last = position_ids.new_full((position_ids.shape[0], 1), length - 1)
            ids = torch.cat((position_ids[:, start : start + n], last), dim=1)
            c, s = self.rotary(x, ids, *args, **kwargs)
            cos.append(c[:, :n])
            sin.append(s[:, :n])
            start += n
        if start != position_ids.shape[1]:  # the runner's spans are this call's tokens
            raise RuntimeError(
                f"rotary spans cover {start} tokens, the call has {position_ids.shape[1]}"
            )
        if len(cos) == 1:
            return cos[0], sin[0]
        return torch.cat(cos, dim=1), torch.cat(sin, dim=1)
