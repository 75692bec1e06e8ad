"""LLMEngine: tokenizer, scheduler, model runner and event publishing, one step at a time.

The engine is synchronous and single-threaded on purpose: :mod:`.async_engine` runs it on a
thread of its own, the offline :class:`kvroute.replica.LLM` drives it in a loop. After every
step the block pool's events (stores and evictions of that step) leave as one batch to each
event sink -- normally a :class:`kvroute.events.ZmqEventPublisher` -- so a router's view
trails the cache by one step at most.

Why per-request guards inside the step: a batch mixes many clients' requests, and a fault
that belongs to one of them -- its seed, sampling, logits, detokenization, stop strings --
must end that request alone (``finish_reason="error"`` and a one-line ``error``) while the
others finish exactly as they would have without it. Only shared state (the model forward,
the KV cache, the scheduler's bookkeeping, running out of memory) may still raise out of
:meth:`LLMEngine.step` and take the engine down; ``current_batch`` then names the requests
whose step failed, so a router can tell a possible query of death from a bystander.

Beside it: :mod:`.output_processor` (what a step makes of each request's tokens: text,
stop strings, outputs, a request's own failure) and :mod:`.lora_adapters` (registering
adapters and requests' adapters), both mixins of :class:`LLMEngine`; and
:mod:`.kv_transfer_wiring` (its side of kv_transfer: the sender, the handoff, counters).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from kvroute.events import BlockHasher, HashConfig, KVCacheEvent, regime_salt
from kvroute.events.bounds import check_prompt_token_ids, check_text
from kvroute.events.kv_transfer import KVHandoff, KVSource
from kvroute.events.load import CostCoefficients
from kvroute.events.replica_api import Resume, SamplingParams

from ..core.detokenizer import IncrementalDetokenizer
from ..core.kv_cache_manager import KVCacheManager
from ..core.outputs import EngineOutput, RequestFailure, SampledToken
from ..core.request import Request, RequestStatus
from ..core.scheduler import Scheduler
from ..core.scheduler_types import SchedulerConfig
from ..core.structured import StructuredOutputCompiler
from ..model.cost_model import Profile, attention_weight, fair_share_floor, sim_profile
from .config import EngineConfig, build_kv_tiers, build_runner, eos_token_ids
from .kv_transfer_wiring import build_kv_plane, build_kv_sender, hand_off, kv_transfer_stats
from .lora_adapters import EngineLoRA
from .output_processor import OutputProcessor, RequestState

if TYPE_CHECKING:  # torch: a cost-model replica never imports it
    from ..kv_transfer.fetcher import KVLink
    from ..kv_transfer.plane import KVPlaneServer, PlaneLink
    from ..kv_transfer.sender import KVSender
    from ..model.lora_store import LoRAStore

log = logging.getLogger(__name__)
_FINISHED_ERROR = RequestStatus.FINISHED_ERROR  # read per token: a class lookup costs more
_RUNNING = RequestStatus.RUNNING

EventSink = Callable[[list[KVCacheEvent]], Any]


def _with_batch_limits(config: EngineConfig, profile: Profile | None) -> EngineConfig:
    """``config`` with its batch limits filled: a cost model's (``profile``, None: a real
    model) from the modelled engine's own, then kvroute's defaults (2048 tokens, 128
    sequences)."""
    if profile is not None:
        config = dataclasses.replace(
            config,
            max_num_batched_tokens=config.max_num_batched_tokens or profile.max_batched_tokens,
            max_num_seqs=config.max_num_seqs or profile.max_num_seqs,
        )
    return dataclasses.replace(
        config,
        max_num_batched_tokens=config.max_num_batched_tokens or 2048,
        max_num_seqs=config.max_num_seqs or 128,
    )


class LLMEngine(EngineLoRA, OutputProcessor):
    """One replica's engine: requests in, token deltas and KV events out."""

    def __init__(
        self,
        config: EngineConfig,
        event_sinks: Sequence[EventSink] = (),
        kv_link: KVLink | None = None,
    ) -> None:
        """``kv_link``: how this engine reaches other replicas' leased blocks (kv_transfer;
        None: it pulls none)."""
        profile = sim_profile(config.model)
        self.config = config = _with_batch_limits(config, profile)
        self.model_path, self.tokenizer, self.runner = build_runner(config)
        path = self.model_path
        self.hasher = BlockHasher(config.hash_algo, config.hash_seed, config.block_size)
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_blocks,
            self.hasher,
            enable_caching=config.enable_prefix_caching,
            hash_form=config.hash_form,
            medium=self.runner.medium,
        )
        self._kv_plane_link: PlaneLink | None = None
        if config.kv_transfer and kv_link is None:  # over ZeroMQ (kv_transfer/plane.py)
            from ..kv_transfer.plane import PlaneLink

            kv_link = self._kv_plane_link = PlaneLink()
        self.kv_tiers = build_kv_tiers(config, self.runner, self.kv_cache_manager, kv_link)
        rope = getattr(self.runner, "rope_spans", None)  # a longrope model (rope_spans)
        # Prompts longer than this are of the long rotary regime, their blocks salted apart
        # (:func:`~kvroute.events.hashing.regime_salt`); None: no switch.
        self.long_prompt_after: int | None = rope.switch if rope is not None else None
        # The length at which a sequence is computed anew with the long factors, as
        # transformers' Phi-3 does; None: never.
        self.switch_recompute_at: int | None = (
            rope.switch if rope is not None and rope.whole_sequence else None
        )
        max_len = min(
            self.runner.max_position_embeddings, self.runner.num_blocks * config.block_size
        )
        if config.max_model_len is not None:
            max_len = min(max_len, config.max_model_len)
        self.max_model_len = max_len
        self.lora: LoRAStore | None = None
        if config.lora_enabled:
            if profile is not None:
                raise ValueError("LoRA adapters need a model; this replica is a cost model")
            self.lora = self._start_lora(config)
        if not config.enforce_eager and profile is None:
            self.runner.enable_decode_graphs(config.max_num_seqs, max_len)
        cost = self.cost_coefficients()
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=max_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                max_num_partial_prefills=config.max_num_partial_prefills,
                attention_weight=attention_weight(cost),
                min_prefill_share_tokens=fair_share_floor(cost),
                max_loras=config.max_loras if self.lora is not None else 0,
            ),
            self.kv_cache_manager,
            lora_ready=self._lora_ready if self.lora is not None else None,
            lora_residency=self.lora.residency if self.lora is not None else None,
        )
        if self.kv_tiers is not None:
            self.scheduler.use_tiers(self.kv_tiers)
        self.kv_sender: KVSender | None = build_kv_sender(
            config, self.kv_cache_manager, self.runner, self.scheduler
        )
        self.kv_plane: KVPlaneServer | None = build_kv_plane(
            config, self.kv_sender, self._kv_plane_link
        )
        self.event_sinks: list[EventSink] = list(event_sinks)
        self.eos_token_id, self.extra_eos_token_ids = eos_token_ids(path, self.tokenizer)
        # Structured outputs compile against the tokenizer, for the logits' width; a cost
        # model has no logits to mask.
        self.structured = (
            None
            if profile is not None
            else StructuredOutputCompiler(
                self.tokenizer,
                self.runner.logits_width,
                [t for t in (self.eos_token_id, *self.extra_eos_token_ids) if t is not None],
            )
        )
        self._states: dict[str, RequestState] = {}
        self.num_steps = 0
        self.num_request_failures = 0  # requests ended by a fault of their own
        # The requests of the step in progress; None while it is not known yet (schedule).
        self.current_batch: frozenset[str] | None = frozenset()

    def _start_lora(self, config: EngineConfig) -> LoRAStore:
        """The runner's LoRA store with ``config``'s adapters registered, and one load timed
        at start (``lora_load_s``, ``lora_read_s``), for routers to price a load here (0:
        none served)."""
        lora = self.runner.enable_lora(
            max_loras=config.max_loras,
            max_cpu_loras=config.max_cpu_loras,
            max_lora_rank=config.max_lora_rank,
        )
        for name, lora_path in config.lora_modules.items():
            lora.register(name, lora_path)
        self.lora_load_s = self.lora_read_s = 0.0
        if config.lora_modules:
            first = next(iter(config.lora_modules))
            self.lora_load_s, self.lora_read_s = lora.measure_load(first)
        return lora

    # -- requests ------------------------------------------------------------------------
    @property
    def hash_config(self) -> HashConfig:
        return self.hasher.config

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding: a prompt token id must be below this."""
        return self.runner.vocab_size

    def cost_coefficients(self) -> CostCoefficients:
        """The step-time model this engine reports to routers (see cost_model)."""
        c = self.config
        coef = self.runner.coefficients(c.model, c.max_num_batched_tokens, c.max_num_seqs)
        if self.lora is not None and self.lora_load_s > 0:  # the load timed at start
            coef = msgspec.structs.replace(
                coef, lora_load_s=self.lora_load_s, lora_read_s=self.lora_read_s
            )
        if self.kv_tiers is not None:  # the load bandwidths measured at start
            tiers = dict(self.kv_tiers.bytes_per_s)
            block_tokens = c.block_size
            coef = msgspec.structs.replace(
                coef,
                kv_bytes_per_token=self.kv_tiers.block_bytes // block_tokens,
                tier_bytes_per_s=tiers,
            )
        return coef

    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt).input_ids)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        arrival_time: float | None = None,
        resume: Resume | None = None,
        tenant: str | None = None,
        deltas: bool = False,
        kv_handoff: bool = False,
        kv_source: KVSource | None = None,
        priority: int = 0,
    ) -> Request:
        """Queues a request; raises ValueError (nothing queued) if it can never run.

        ``resume``: a request continued here after its replica failed mid-stream; its
        outputs so far count as generated here (see :class:`~kvroute.events.replica_api.Resume`).
        ``tenant``: whose request; waiting requests are admitted tenant by tenant in turn
        (None: the group of requests without one). ``deltas``: its outputs are the data
        plane's :class:`GenerateDelta` (what the step added), not :class:`RequestOutput`: a
        replica sends only increments, so nothing cumulative is copied per token for it.
        ``kv_handoff``: prefill here, decode elsewhere: it ends after its first token with
        ``finish_reason="handoff"`` and a :class:`KVHandoff` (unless that token ended it).
        ``kv_source``: the replica whose lease holds its prompt blocks (with ``resume``,
        the first token generated there): it pulls what it does not hold.
        ``priority``: lower is admitted first and may preempt less urgent running requests
        (vLLM's meaning; default 0).
        """
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        if kv_handoff and self.kv_sender is None:
            raise ValueError("kv_handoff needs a replica with kv_transfer")
        if kv_source is not None and (self.kv_tiers is None or self.kv_tiers.remote is None):
            raise ValueError("kv_source needs a replica with kv_transfer and a link to pull over")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self._prompt_token_ids(prompt)
        lora_path = self._lora_path(lora_name) if lora_name is not None else None
        prior = list(resume.output_token_ids) if resume is not None else []
        params = self._params_to_run(params or SamplingParams(), prior)
        # past a rotary switch its blocks' keys are of the other regime (rope_spans); on
        # Phi-3 a resumed request's earlier outputs count too (the whole sequence's regime)
        length = len(token_ids) + (len(prior) if self.switch_recompute_at is not None else 0)
        cache_salt = regime_salt(cache_salt, length, self.long_prompt_after)
        req = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            cache_salt=cache_salt,
            lora_name=lora_name,
            lora_path=lora_path,
            arrival_time=arrival_time,
            output_token_ids=prior,
            tenant=tenant,
            kv_handoff=kv_handoff,
            kv_source=kv_source,
            priority=priority,
        )
        if params.structured_outputs is not None:
            if self.structured is None:
                raise ValueError("structured_outputs need a model; this replica is a cost model")
            req.grammar = self.structured.matcher(params.structured_outputs, prior)
        detok = IncrementalDetokenizer(self.tokenizer, params.stop)
        detokenizes = self.config.stream_text or bool(detok.stop)
        if prior and resume is not None and detokenizes:
            try:  # before queueing: a failure here leaves nothing behind
                detok.resume(prior, resume.sent_chars)
            except Exception as exc:
                raise ValueError(f"the resumed outputs cannot be decoded ({exc!r})") from exc
        self.scheduler.add_request(req)
        if self.lora is not None and lora_name is not None and lora_path is not None:
            self.lora.ready(lora_name, lora_path)  # starts reading it now, if need be
        state = RequestState(req, text, detok, detokenizes, deltas)
        self._states[request_id] = state
        if prior and resume is not None:
            state.resumed_chars = resume.sent_chars
            self.runner.prime(request_id, params, len(prior))
        return req

    def _prompt_token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """``add_request``'s prompt as token ids, checked against the vocabulary (ValueError:
        it can never run)."""
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            try:
                token_ids = self.tokenize(prompt)
            except Exception as exc:  # e.g. a lone surrogate: the prompt's fault, a 4xx
                raise ValueError(f"the prompt cannot be tokenized ({type(exc).__name__})") from exc
        else:
            token_ids = [t if isinstance(t, bool) else operator.index(t) for t in prompt]
        check_prompt_token_ids(token_ids, self.vocab_size)
        return token_ids

    def _params_to_run(self, params: SamplingParams, prior: list[int]) -> SamplingParams:
        """``add_request``'s ``params`` as this engine runs them: the model's other EOS tokens
        added, a resumed request's (``prior``: its outputs so far) prompt logprobs dropped;
        ValueError where they can never run."""
        vocab = self.vocab_size
        if self.extra_eos_token_ids and not params.ignore_eos:
            # generation_config.json may name several EOS tokens (chat models often do).
            params = msgspec.structs.replace(
                params, stop_token_ids=[*params.stop_token_ids, *self.extra_eos_token_ids]
            )
        if prior:
            check_prompt_token_ids(prior, vocab)
            if params.prompt_logprobs is not None:  # its client has them from the first replica
                params = msgspec.structs.replace(params, prompt_logprobs=None)
            if len(prior) >= params.max_tokens:
                raise ValueError("a resumed request must have tokens left to generate")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:
                # Caught here, not in a topk, where it would fail the whole step.
                raise ValueError(f"{name} must be <= the vocabulary size {vocab}, got {k}")
        return params

    def abort_requests(self, request_ids: Sequence[str]) -> list[EngineOutput]:
        """Frees the requests' blocks now; returns their final (aborted) outputs."""
        live = [rid for rid in request_ids if rid in self._states]
        self.scheduler.abort_requests(live)
        outs = []
        for rid in live:
            try:  # the final text (a flush, or a decode) is this request's own work
                outs.append(self._output(self._states[rid], [], ""))
            except Exception as exc:
                outs.append(self._fail(rid, "detokenization", exc))
                continue
            self._forget(rid)
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        if self.scheduler.leases is not None:
            self.scheduler.leases.clear()  # leased blocks would keep the reset from happening
        ok = self.kv_cache_manager.reset_prefix_cache()
        self._publish_events()
        return ok

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """Schedules, runs the model once, applies the sampled tokens, publishes events.

        A request whose own stage fails (see the module docstring) comes back finished with
        ``finish_reason="error"``; the step goes on for the others."""
        self.current_batch = None
        outputs: list[EngineOutput] = self._lora_failures() if self.lora is not None else []
        sched = self.scheduler.schedule()
        self.current_batch = frozenset(item.request.request_id for item in sched.scheduled)
        for rid in sched.finished_request_ids:
            self.runner.forget(rid)
        while self.scheduler.unfit_req_ids:  # ended in the scheduler: each gets its output
            outputs.append(self._fail(self.scheduler.unfit_req_ids.pop(), "scheduling", None))
        if not sched.scheduled and self.lora is not None:
            self.lora.wait(0.01)  # nothing to run but adapters being read: do not spin
        if not sched.scheduled and self.scheduler.loading:
            self.kv_tiers.wait(0.01)  # type: ignore[union-attr]  # nothing but KV loads
        results: dict[str, SampledToken | RequestFailure] = {}
        if sched.scheduled:
            t0 = time.perf_counter()
            results = self.runner.execute(sched)
            if self.scheduler.kv_loads is not None:  # how long a load may hold a step
                self.scheduler.kv_loads.note_step(time.perf_counter() - t0)
        sampled: dict[str, SampledToken] = {}
        for rid, result in results.items():
            if isinstance(result, RequestFailure) and result.stage == "LoRA adapter":
                outputs.append(self._fail_lora(rid, result.error))
            elif isinstance(result, RequestFailure):
                outputs.append(self._fail(rid, result.stage, result.error))
            else:
                sampled[rid] = result
        updated = self.scheduler.update_from_output(
            sched, {rid: s.token_id for rid, s in sampled.items()}
        )
        for req in updated:
            if req.status == _FINISHED_ERROR:  # its stop check failed
                outputs.append(self._fail(req.request_id, "stop check", None))
                continue
            if req.grammar is not None and req.request_id in sampled:
                try:
                    self._advance_grammar(req, sampled[req.request_id].token_id)
                except Exception as exc:
                    outputs.append(self._fail(req.request_id, "structured outputs", exc))
                    continue
            try:
                outputs.append(self._on_update(req, sampled.get(req.request_id)))
            except Exception as exc:  # its text: detokenization and stop strings
                outputs.append(self._fail(req.request_id, "detokenization", exc))
        at = self.switch_recompute_at
        if at is not None:  # Phi-3: a sequence reaching its rotary switch is computed anew
            for req in updated:
                if req.status == _RUNNING and req.num_tokens == at + 1 >= req.num_prompt_tokens + 1:
                    req.cache_salt = regime_salt(req.cache_salt, at + 1, at)  # long keys now
                    self.scheduler.recompute(req)
        self.num_steps += 1
        self._publish_events()
        self.current_batch = frozenset()
        return outputs

    def _advance_grammar(self, req: Request, token_id: int) -> None:
        """The matcher takes the sampled token; a grammar that is complete ends the request
        (its last token is the stop token the grammar allows there; with ``ignore_eos`` the
        scheduler would go on)."""
        if not req.grammar.accept_token(token_id):
            raise ValueError(f"token {token_id} breaks the request's structured output")
        if req.grammar.is_terminated() and not req.is_finished:
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)

    def _hand_off(self, req: Request) -> KVHandoff:
        """Ends ``req`` here with its prompt blocks leased (see :meth:`Scheduler.hand_off`)."""
        return hand_off(self.scheduler, self.kv_sender, self.config.kv_lease_s, req)

    def _publish_events(self) -> None:
        events = self.kv_cache_manager.take_events()
        if events:
            for sink in self.event_sinks:
                sink(events)

    # -- observation ---------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        s = dict(self.scheduler.stats())
        s["num_blocks"] = self.runner.num_blocks
        s["block_size"] = self.config.block_size
        s["steps"] = self.num_steps
        runner_stats = getattr(self.runner, "stats", None)
        if runner_stats is not None:
            s.update(runner_stats())
        s.update(
            kv_transfer_stats(self.kv_sender, self.kv_tiers, self.kv_plane, self._kv_plane_link)
        )
        if self.kv_tiers is not None:
            t = self.kv_tiers
            s.update({f"kv_tier_{k}": v for k, v in t.counters().items()})
            s["kv_host_blocks"] = len(t.host)
            s["kv_disk_blocks"] = len(t.disk_meta)
            s["kv_tier_loads_inline"] = self.scheduler.kv_loads.num_inline  # type: ignore[union-attr]
            s["kv_disk_pending"] = t.disk.num_pending if t.disk is not None else 0
        return s

    def close(self) -> None:
        """Stops the KV tiers' threads and removes the disk tier's folder (tenants' data);
        the engine is not used after. :class:`.async_engine.AsyncEngine` calls it when its
        thread ends."""
        if self.kv_tiers is not None:
            self.kv_tiers.close()
        if self._kv_plane_link is not None:
            self._kv_plane_link.close()
        if self.kv_plane is not None:
            self.kv_plane.close()
