"""Turns one step's last-position logits into one token per sampling request.

Why per-request generators: a request with ``seed`` must draw the same tokens whatever else
shares its batch, so each seeded request owns a ``torch.Generator`` that lives as long as the
request; unseeded ones share the engine's generator. Greedy rows never draw at all.

Why each row is guarded on its own: a seed, a temperature or a top-k belong to one request,
and a value that makes torch raise for it (the query of death: a seed torch cannot unpack)
must fail that request alone, not the step every other request of the batch shares. A row
that raises comes back as a :class:`RequestFailure` in its place.

Sampling uses the exponential race (``argmax(p / E)``, ``E ~ Exp(1)``), which equals a draw
from ``p`` and needs no cumulative sum per row.

A logit bias and penalties change a row's logits before greedy or sampling, as vLLM's do
(the bias, then repetition over the prompt and output tokens, then frequency and presence
over the output's counts); logprobs stay those of the raw logits (vLLM's default). Only
rows that ask for one pay for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvroute.events.replica_api import SamplingParams

from ..core.outputs import RequestFailure, SampledToken
from ..core.structured import mask_logits

__all__ = ["RequestFailure", "SampledToken", "Sampler"]


class Sampler:
    """Stateless across steps except for the generators of seeded requests."""

    def __init__(self, seed: int = 0) -> None:
        self._shared = torch.Generator().manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._shared
        gen = self._per_request.get(request_id)
        if gen is None:
            # torch takes any value in [-2**63, 2**64); the shared bounds keep seeds in int64.
            gen = torch.Generator().manual_seed(params.seed)
            self._per_request[request_id] = gen
        return gen

    @torch.inference_mode()
    def prime(self, request_id: str, params: SamplingParams, draws: int, vocab: int) -> None:
        """A seeded request continued from ``draws`` tokens generated elsewhere: its
        generator skips the draws those tokens took (one race over the vocabulary each), so
        the next token is the one the first replica would have drawn."""
        if params.seed is None or params.temperature == 0.0:
            return
        gen = self._generator(request_id, params)
        for _ in range(draws):
            torch.empty(vocab).exponential_(generator=gen)

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        token_ids: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
        grammars: Sequence[Any] | None = None,
    ) -> list[SampledToken | RequestFailure]:
        """``logits``: [num_requests, vocab] for the requests in ``request_ids`` order.
        ``token_ids``: each request's (prompt and output so far, output so far), read only
        where it asks for a bias or a penalty. ``grammars``: each request's structured-output
        matcher or None; a constrained row loses the tokens its grammar forbids first (as in
        vLLM, before the logprobs are taken).

        Batch-wide work (argmax, log-softmax) may raise: that is shared state. Per-row work
        that raises yields a :class:`RequestFailure` for that row only."""
        logits = logits.float()
        failed: dict[int, RequestFailure] = {}
        if grammars is not None and any(g is not None for g in grammars):
            failed.update(_constrain(logits, grammars))
        want_logprobs = any(p.logprobs is not None for p in params)
        logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        penalized = [i for i, p in enumerate(params) if p.has_penalties and i not in failed]
        if penalized:
            logits = logits.clone()  # the raw logits' logprobs were taken above
            for i in penalized:
                try:
                    if token_ids is None:
                        raise ValueError("penalties need the request's token ids")
                    _penalize(logits[i], params[i], *token_ids[i])
                except Exception as exc:
                    failed[i] = RequestFailure("penalties", exc)
        greedy = logits.argmax(dim=-1).tolist()
        out: list[SampledToken | RequestFailure] = []
        for i, (rid, p) in enumerate(zip(request_ids, params, strict=True)):
            if i in failed:
                out.append(failed[i])
                continue
            stage = "seed"
            try:
                if p.temperature == 0.0:
                    token = greedy[i]
                else:
                    gen = self._generator(rid, p)
                    stage = "sampling"
                    token = self._draw(logits[i], p, gen)
                sampled = SampledToken(token)
                if logprobs is not None and p.logprobs is not None:
                    stage = "logprobs"
                    row = logprobs[i]
                    sampled.logprob = float(row[token])
                    if p.logprobs > 0:
                        vals, idx = row.topk(p.logprobs)
                        sampled.top_logprobs = dict(zip(idx.tolist(), vals.tolist(), strict=True))
            except Exception as exc:
                out.append(RequestFailure(stage, exc))
                continue
            out.append(sampled)
        return out

    def _draw(self, row: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
        row = row / p.temperature
        if p.min_p > 0.0:  # vLLM's order: after temperature, before top-k and top-p
            probs = torch.softmax(row, dim=-1)
            row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if 0 < p.top_k < row.numel():
            kth = row.topk(p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest head whose mass reaches top_p (always at least one token).
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        # The generators live on the CPU (as in ``prime``), so the race is drawn there and
        # moved: a CUDA tensor cannot take a CPU generator, and a seeded request draws the
        # same stream on a CPU and a GPU replica.
        race = torch.empty(probs.shape, dtype=probs.dtype).exponential_(generator=generator)
        return int((probs / race.to(probs.device)).argmax())


def _constrain(logits: torch.Tensor, grammars: Sequence[Any]) -> dict[int, RequestFailure]:
    """Masks the constrained rows in one call; if that fails, row by row, so a bad matcher
    fails its own request only."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    try:
        mask_logits(logits, rows, [grammars[i] for i in rows])
        return {}
    except Exception:
        failed = {}
        for i in rows:
            try:
                mask_logits(logits, [i], [grammars[i]])
            except Exception as exc:
                failed[i] = RequestFailure("structured outputs", exc)
        return failed


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[dict[int, float]]:
    """Row i's logprob of ``targets[i]`` and its ``k`` likeliest tokens, from the raw
    logits (as vLLM's prompt logprobs): ``{token id: logprob}``, the target always in."""
    rows = torch.log_softmax(logits.float(), dim=-1)
    chosen = rows.gather(1, torch.tensor(targets, device=rows.device)[:, None])[:, 0].tolist()
    if k:
        vals, idx = rows.topk(k, dim=-1)
        pairs = zip(idx.tolist(), vals.tolist(), strict=True)
        entries = [dict(zip(i, v, strict=True)) for i, v in pairs]
    else:
        entries = [{} for _ in targets]
    for entry, target, lp in zip(entries, targets, chosen, strict=True):
        entry[target] = lp
    return entries


def _penalize(
    row: torch.Tensor, p: SamplingParams, seen_ids: Sequence[int], output: Sequence[int]
) -> None:
    """Applies ``p``'s logit bias and penalties to one row of logits, in place (vLLM's
    order and formulas)."""
    vocab, dev = row.numel(), row.device
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=dev)
        if int(ids.max()) >= vocab:
            raise ValueError(f"logit_bias: token id {int(ids.max())} is past the vocabulary")
        row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=dev)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(seen_ids, dtype=torch.long, device=dev).unique()
        seen = seen[seen < vocab]
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if output and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(torch.tensor(output, dtype=torch.long, device=dev), minlength=vocab)
        counts = counts[:vocab].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
