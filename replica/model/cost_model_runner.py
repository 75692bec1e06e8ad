"""CostModelRunner: the engine's model runner with the forward pass replaced by a sleep.

Why: a fleet large enough for routing to matter (dozens of H100 replicas) cannot run here,
but everything around the matrix multiplications can. With this runner a replica is the
ordinary engine -- the real ``Scheduler``, ``KVCacheManager``, ``BlockPool``, hashing, event
publisher and load reports, inside the ordinary Ray actor -- whose every step lasts what
:mod:`.cost_model` says the modelled GPU would take (Dynamo's "mocker" does the same).

Time: a step of modelled duration ``t`` ends ``t * time_scale`` after the previous step
ended (or after it was scheduled, when the engine was idle), so the engine's own Python time
is absorbed into the modelled time, not added to it. ``time_scale`` > 1 slows the whole
fleet down so that a small CPU keeps up; measured latencies divided by ``time_scale`` are
modelled seconds (and arrival rates must be divided by it too). A step whose Python work
outlasted its modelled time is late: ``stats()`` counts it, so a run can show it stayed
faithful.

Tokens: sampled ids are pseudo-random printable ASCII bytes, fixed by (prompt, output
position), as greedy decoding would fix them: deterministic, decodable by the built-in byte
tokenizer, never an EOS, so a request runs to ``max_tokens`` as the simulator assumes; a
request resumed on another replica continues with the very tokens it would have got.
"""

from __future__ import annotations

import time
import zlib
from array import array
from collections.abc import Sequence
from typing import Any

from kvroute.events.load import CostCoefficients
from kvroute.events.replica_api import SamplingParams

from ..core.outputs import SampledToken
from ..core.scheduler_types import SchedulerOutput
from .cost_model import CostModel, Profile

_FIRST, _SPAN = 32, 95  # printable ASCII: ' ' .. '~'


def prompt_key(prompt_token_ids: list[int]) -> int:
    return zlib.crc32(array("Q", prompt_token_ids).tobytes())


def output_token(key: int, position: int) -> int:
    """The token a cost-model replica emits at output ``position`` for a prompt's ``key``."""
    x = (key * 0x9E3779B1 + (position + 1) * 0x85EBCA77) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 12
    return _FIRST + x % _SPAN


class CostModelRunner:
    """Same surface as :class:`~.model_runner.ModelRunner`; no weights, no KV tensors."""

    medium = "GPU"  # what it models; block events name the medium of the modelled cache

    def __init__(
        self,
        profile: Profile,
        *,
        block_size: int,
        num_blocks: int | None = None,
        time_scale: float = 1.0,
    ) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.profile = profile
        self.cost = CostModel(profile)
        self.block_size = block_size
        self.num_blocks = num_blocks or max(profile.kv_tokens // block_size, 1)
        self.time_scale = time_scale
        self._prev_end = 0.0
        self.num_steps = 0
        self.modelled_s = 0.0  # sum of modelled step times (unscaled)
        self.num_late_steps = 0  # steps whose Python work outlasted their scaled time
        self.late_s = 0.0
        self._keys: dict[str, int] = {}  # request id -> prompt_key, hashed once

    @property
    def max_position_embeddings(self) -> int:
        return self.profile.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.profile.vocab_size

    def prime(self, request_id: str, params: SamplingParams, draws: int) -> None:
        """Nothing to skip: tokens depend on the position alone."""

    def forget(self, request_id: str) -> None:
        self._keys.pop(request_id, None)

    def coefficients(
        self, name: str, max_batched_tokens: int, max_num_seqs: int, tiers: Sequence[str] = ()
    ) -> CostCoefficients:
        """The profile's coefficients in wall-clock seconds: scaled like the steps are (a
        tier's bandwidth too), with the bandwidths of the lower tiers the engine keeps."""
        c = self.cost.coefficients(tiers)
        s = self.time_scale
        return CostCoefficients(
            prefill_s_per_token=c.prefill_s_per_token * s,
            attention_s_per_pair=c.attention_s_per_pair * s,
            step_overhead_s=c.step_overhead_s * s,
            weights_read_s=c.weights_read_s * s,
            kv_read_s_per_token=c.kv_read_s_per_token * s,
            kv_capacity_tokens=self.num_blocks * self.block_size,
            max_batched_tokens=max_batched_tokens,
            max_num_seqs=max_num_seqs,
            source=f"profile:{self.profile.name}" + (f" x{s:g}" if s != 1.0 else ""),
            kv_bytes_per_token=c.kv_bytes_per_token,
            tier_bytes_per_s={t: bw / s for t, bw in c.tier_bytes_per_s.items()},
        )

    def execute(self, sched: SchedulerOutput) -> dict[str, SampledToken]:
        """Sleeps for the batch's modelled step time; samples the requests that reach their end."""
        tokens, pairs, ctx = 0, 0.0, 0
        sampled: dict[str, SampledToken] = {}
        for item in sched.scheduled:
            n, p0 = item.num_new_tokens, item.num_computed_tokens
            tokens += n
            pairs += n * p0 + n * (n - 1) / 2
            ctx += p0 + n
            req = item.request
            if req.prompt_logprobs is not None:  # a sure prompt, as the outputs' logprobs
                ids, have = req.prompt_token_ids, len(req.prompt_logprobs)
                stop = min(p0 + n, len(ids) - 1)
                req.prompt_logprobs.extend({ids[i + 1]: 0.0} for i in range(have - 1, stop))
            if item.samples:
                key = self._keys.get(req.request_id)
                if key is None:
                    key = self._keys[req.request_id] = prompt_key(req.prompt_token_ids)
                tok = output_token(key, len(req.output_token_ids))
                want_logprobs = req.sampling_params.logprobs is not None
                sampled[req.request_id] = SampledToken(
                    tok, 0.0 if want_logprobs else None, {tok: 0.0} if want_logprobs else None
                )
        if not tokens:
            return sampled
        modelled = self.cost.step_time(tokens, pairs, ctx)
        dt = modelled * self.time_scale
        now = time.perf_counter()
        # Back to back with the previous step: the engine's Python time since it ended is
        # part of this step's modelled time. After an idle gap: the step starts now.
        begin = self._prev_end if now - self._prev_end < dt else now
        end = begin + dt
        if end > now:
            time.sleep(end - now)
        else:
            self.num_late_steps += 1
            self.late_s += now - end
        self._prev_end = max(end, now)
        self.num_steps += 1
        self.modelled_s += modelled
        return sampled

    def stats(self) -> dict[str, Any]:
        return {
            "time_scale": self.time_scale,
            "modelled_busy_s": round(self.modelled_s, 6),
            "late_steps": self.num_late_steps,
            "late_s": round(self.late_s, 6),
        }
