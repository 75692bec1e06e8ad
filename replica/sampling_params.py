"""Per-request sampling and stopping parameters, vLLM-style names.

Validated once, at construction, against the bounds :mod:`kvroute.events.replica_api` shares
with the front door, so the scheduler and sampler never meet a nonsensical value (a negative
``max_tokens`` would only surface as a request that never finishes, a seed past int64 as a
sampler that raises).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroute.events.bounds import check_sampling


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` means greedy. ``top_k == 0`` (or vLLM's ``-1``, normalised to 0)
    disables top-k. ``min_tokens`` suppresses EOS and ``stop_token_ids`` until that many
    tokens were generated (``max_tokens`` still applies). ``stop`` strings are matched by
    the engine on detokenised text; the scheduler only handles token-level stops.
    """

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs to return per token (None = off)

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        check_sampling(self)  # the bounds the front door checks too

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0
