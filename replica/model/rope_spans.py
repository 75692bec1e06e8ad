"""longrope rotary embeddings, computed per regime of the step.

Why: transformers' ``longrope`` rotary (Phi-3's 128k models, Phi-3.5, Phi-4-mini) takes its
long factors when the longest position of the call passes the pre-training length
(``original_max_position_embeddings``, "the switch"), else its short ones: it reads
``max(position_ids) + 1`` of the whole call. kvroute runs the step's sequences as one
flattened call, so one long prompt switched every short sequence batched with it to the
long factors: a 5-token prompt beside a 100-token one got other greedy tokens than alone
(found by probing every architecture transformers ships; now a test in
tests/replica/model/test_model_families.py).

How: the model's rotary module is wrapped. Each step the runner says, per sequence, where
its new tokens start, how many there are, how long its prompt is and how many tokens it
has (:meth:`PerSequenceRotary.step`). A token at position ``p`` gets the factors
transformers gives it in ``generate``, which computes it in one call of length ``L(p) =
max(prompt, p + 1)``: the whole prompt in the prefill, each output token in its own decode
step. The wrapper calls the module once per run of adjacent tokens of one regime (``L`` up
to the switch, or past it), with one position more, ``L - 1``, appended and its output
dropped, so the module's own ``max(position_ids) + 1`` is that ``L`` (the module sets its
frequencies from it on every call). So a prompt chunked over several steps, a preempted
request's recompute and a decode batch mixing short and long sequences all get
transformers' own factors. Models with this rotary run eager on CUDA (no decode graphs:
the calls depend on the step). Other rotary types are not wrapped: static ones (default,
linear, llama3, yarn) need nothing, and ``dynamic`` (NTK) rescales only past
``max_position_embeddings``, which the engine's ``max_model_len`` never exceeds.

The Phi-3 family (``RECOMPUTE_AT_SWITCH``) differs: transformers drops the cache where a
sequence crosses the switch and computes it again, so there every token of a step takes
``L =`` the sequence's whole length, and the engine recomputes a request that crosses
(``LLMEngine.step``), then salts it long.

Cached prefixes: one computed for a prompt in the other regime (a short prompt's blocks
reused by a long one, or the reverse) holds keys of that regime, where transformers
recomputes them; so prompts past the switch are hashed with their own salt
(:func:`kvroute.events.hashing.regime_salt`, by the engine and by routers, which learn the
switch from the replica's ``ReplicaInfo.long_prompt_after``), and the two regimes' blocks
never meet.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = ["PerSequenceRotary", "longrope_switch"]

# model_types whose transformers class recomputes its whole cache at the switch
# (``prepare_inputs_for_generation`` of Phi3ForCausalLM and PhimoeForCausalLM, 5.19)
RECOMPUTE_AT_SWITCH = frozenset({"phi3", "phimoe"})


def _is_longrope(params: object) -> bool:
    return isinstance(params, dict) and params.get("rope_type", params.get("type")) == "longrope"


def longrope_switch(config: object) -> int | None:
    """The length past which a longrope config takes its long factors (transformers reads
    ``original_max_position_embeddings`` from the rotary parameters, per layer type where
    they are given so; the config's own field otherwise); None: not longrope."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return None
    layers = [p for p in params.values() if _is_longrope(p)]  # per layer type (Gemma3)
    if not (_is_longrope(params) or layers):
        return None
    found = [int(p["original_max_position_embeddings"]) for p in (params, *layers)
             if isinstance(p, dict) and p.get("original_max_position_embeddings")]  # fmt: skip
    if not found and getattr(config, "original_max_position_embeddings", None):
        found = [int(config.original_max_position_embeddings)]  # type: ignore[attr-defined]
    if not found:
        raise ValueError("longrope rotary without original_max_position_embeddings")
    return min(found)


class PerSequenceRotary(nn.Module):
    """Calls ``rotary`` per regime run of the step (module docstring); outside a step (no
    :meth:`step` call), once over everything."""

    def __init__(self, rotary: nn.Module, config: object, switch: int) -> None:
        super().__init__()
        self.rotary = rotary
        self.switch = switch
        # transformers' Phi-3 family drops its cache where a sequence crosses the switch and
        # recomputes it with the long factors: every token of a sequence then takes the
        # regime of the sequence's whole length (module docstring)
        self.whole_sequence = getattr(config, "model_type", None) in RECOMPUTE_AT_SWITCH
        self._runs: list[tuple[int, int]] | None = None  # (tokens, call length) per run

    def step(self, spans: Sequence[tuple[int, int, int, int]]) -> None:
        """This step's sequences, in token order: (first new position, new tokens, prompt
        tokens, all its tokens so far) of each."""
        runs: list[list[int]] = []  # [tokens, long?, length for the call]
        for start, n, prompt, total in spans:
            end = start + n
            if self.whole_sequence:  # Phi-3: the regime of the sequence's whole length
                pieces = [(n, total)]
            else:  # prompt tokens as in one call of the whole prompt, outputs at their own
                pieces = [(min(end, prompt) - start, prompt)] if start < prompt else []
                pieces += [(1, p + 1) for p in range(max(start, prompt), end)]
            for count, length in pieces:
                long = int(length > self.switch)
                if runs and runs[-1][1] == long:
                    runs[-1][0] += count
                    runs[-1][2] = max(runs[-1][2], length)
                else:
                    runs.append([count, long, length])
        self._runs = [(count, length) for count, _, length in runs]

    def done(self) -> None:
        self._runs = None

    def forward(
        self, x: Tensor, position_ids: Tensor, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        runs = self._runs
        if runs is None:  # outside a step (the load probe): the module as it is
            return self.rotary(x, position_ids, *args, **kwargs)
        cos, sin, start = [], [], 0
        for n, length in runs:
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
