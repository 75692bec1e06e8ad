"""Runs one engine step: a flattened varlen batch through the model over the paged cache.

Two model implementations (``model_impl``, as vLLM's ``--model-impl``):

* ``kvroute`` -- the Llama family (Llama, Mistral, Qwen2, Qwen3, Gemma3) through kvroute's own
  decoder (:mod:`.decoder`): fused projections, attention on the paged cache directly.
  The default for those families.
* ``transformers`` -- any other decoder: transformers' own modules, which call the
  attention function kvroute registers with transformers (:mod:`.hf_attention`): it writes
  the step's K/V into the paged cache and attends over it. A model this path cannot run
  exactly is refused at load, by a probe forward pass: an attention argument the kernels
  do not implement (Gemma2's ``softcap``, gpt-oss's sinks), a mask or bias of its own, K/V
  not shaped as the config says, or layers that do not attend through the interface
  (linear attention, Mamba).

The batch is one sequence of ``num_scheduled_tokens`` tokens (batch dimension 1): prefills,
chunks over a cached prefix and decodes side by side, each token with its own position.
Only the last position of a request that samples this step goes through the LM head, and
every prompt position of a request that asked for its prompt's logprobs.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from kvroute.events import MEDIUM_GPU
from kvroute.events.load import CostCoefficients
from kvroute.events.replica_api import SamplingParams
from kvroute.kernels import AttentionMetadata, select_backend

from ..core.outputs import RequestFailure, SampledToken
from ..core.scheduler_types import SchedulerOutput
from .cuda_graphs import Capture, DecodeGraphs
from .decoder import PagedDecoder, unsupported
from .hf_attention import (
    ATTN_IMPLEMENTATION,
    FORWARD_CONTEXT,
    ForwardContext,
    UnsupportedModelError,
    refuse_logit_processing,
)
from .linear import Linear
from .lora_store import LoRAStep, LoRAStore
from .rope_spans import PerSequenceRotary, longrope_switch
from .sampler import Sampler, prompt_logprobs

log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30
# Prompt positions whose logits are taken at once, for prompt logprobs: a bound on the
# [rows, vocab] float32 block (512 x 128k vocab = 256 MiB).
PROMPT_LOGPROBS_ROWS = 512
# Room for one step's activations on a GPU, not profiled (vLLM runs a dummy step instead).
ACTIVATION_MARGIN_BYTES = 2 << 30


MODEL_IMPLS = ("auto", "kvroute", "transformers")


def kv_layout(config: PretrainedConfig) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a transformers decoder config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return config.num_hidden_layers, kv_heads, head_dim


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes across all layers."""
    layers, kv_heads, head_dim = kv_layout(config)
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    """Owns the model weights, the paged KV cache tensors and the sampler of one engine."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        block_size: int,
        num_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        seed: int = 0,
        model_impl: str = "auto",
    ) -> None:
        if model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.dtype = dtype
        self.block_size = block_size
        t0 = time.perf_counter()
        try:
            model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
            )
        except KeyError as exc:  # modules that pick an attention class of their own by name
            if exc.args != (ATTN_IMPLEMENTATION,):
                raise
            raise UnsupportedModelError(
                f"the model at {model_path} picks its attention classes by name and has none "
                "for kvroute's paged attention (it does not use transformers' attention "
                "registry, as GPT-J and Falcon do not)"
            ) from exc
        self.model = model.to(self.device)
        self.model.eval()
        log.info("loaded %s in %.1f s", model_path, time.perf_counter() - t0)
        self.lm_head = self.model.get_output_embeddings()
        # The logits' projection: the LM head's weight prepacked on CPU (.linear says why);
        # a tied weight stays the embedding's too.
        self.project_logits = (
            Linear(self.lm_head.weight, self.lm_head.bias)
            if isinstance(self.lm_head, torch.nn.Linear)
            else self.lm_head
        )
        cfg = self.model.config
        refuse_logit_processing(cfg)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        num_layers, kv_heads, head_dim = kv_layout(cfg)
        # The decoder first: fusing its weights must not compete with the KV cache for
        # the memory the cache is sized from.
        why_not = unsupported(cfg)
        if model_impl == "kvroute" and why_not is not None:
            raise UnsupportedModelError(f"model_impl kvroute: {why_not}")
        use_own = model_impl != "transformers" and why_not is None
        self.model_impl = "kvroute" if use_own else "transformers"
        self.decoder = self.model.get_decoder()
        self.rope_spans = self._per_sequence_rope(cfg)
        # The kernels, chosen once (the only read of KVROUTE_KERNELS_BACKEND and
        # KVROUTE_CPU_*_KERNEL): no step looks at the environment.
        self.kernels = select_backend(self.device)
        log.info("kernel backend: %r", self.kernels)
        self.paged_decoder = PagedDecoder(self.model, self.kernels) if use_own else None
        self.decode_graphs: DecodeGraphs | None = None
        if use_own and self.device.type == "cuda":
            torch.cuda.empty_cache()  # the unfused weights' blocks back to the driver
        if num_blocks is None:
            budget = kv_cache_memory_bytes or self._default_kv_budget(gpu_memory_utilization)
            per_block = kv_bytes_per_token(cfg, dtype) * block_size
            num_blocks = max(int(budget // per_block), 1)
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=self.device),
                torch.zeros(shape, dtype=dtype, device=self.device),
            )
            for _ in range(num_layers)
        ]
        self.sampler = Sampler(seed)
        self.lora: LoRAStore | None = None  # see enable_lora
        if self.paged_decoder is None:
            self._probe_transformers_path(num_layers)
        log.info("model implementation: %s", self.model_impl)

    def enable_decode_graphs(
        self, max_num_seqs: int, max_model_len: int, *, capture: Capture | None = None
    ) -> None:
        """CUDA graphs for decode batches (kvroute's decoder on CUDA; ``capture`` stands in
        for CUDA in tests). Logs what capture took; a failed capture or self-check leaves
        the runner eager, with a warning saying why (see :mod:`.cuda_graphs`). Graphs
        captured before are dropped first: a failed call never leaves old ones in use."""
        self.decode_graphs = None
        decoder = self.paged_decoder
        if decoder is None or (capture is None and self.device.type != "cuda"):
            return
        if self.rope_spans is not None:
            log.info("decode CUDA graphs off: the rotary frequencies follow each sequence's length")
            return
        graphs = DecodeGraphs(
            lambda ids, pos, meta: decoder(ids, pos, self.kv_caches, meta),
            max_num_seqs=max_num_seqs,
            max_blocks_per_seq=-(-max_model_len // self.block_size),
            block_size=self.block_size,
            device=self.device,
            capture=capture,
        )
        cuda = self.device.type == "cuda"
        before = torch.cuda.memory_reserved(self.device) if cuda else 0
        tol = 1e-4 if self.dtype == torch.float32 else 2e-2
        try:
            with torch.inference_mode():
                seconds = graphs.capture_all()
                why = graphs.self_check(self.num_blocks, atol=tol, rtol=tol)
        except Exception as exc:  # a model whose forward cannot be captured: run eager
            why = f"capture failed: {type(exc).__name__}: {exc}"
        if why is not None:
            log.warning("decode CUDA graphs off, running eager: %s", why)
            return
        mib = ((torch.cuda.memory_reserved(self.device) if cuda else 0) - before) / 2**20
        log.info(
            "captured %d decode graphs (batch 1-%d) in %.1f s, %.0f MiB",
            len(graphs.buckets),
            graphs.max_batch,
            seconds,
            mib,
        )
        self.decode_graphs = graphs

    def enable_lora(
        self, *, max_loras: int, max_cpu_loras: int | None, max_lora_rank: int
    ) -> LoRAStore:
        """Device slots for LoRA adapters (:mod:`.lora_store`). kvroute's decoder only:
        transformers' modules have no place for the grouped products."""
        decoder = self.paged_decoder
        if decoder is None:
            raise UnsupportedModelError(
                "LoRA adapters need model_impl 'kvroute' (Llama, Mistral, Qwen2, Qwen3, Gemma3); "
                f"this model runs on model_impl {self.model_impl!r}"
            )
        self.lora = LoRAStore(
            decoder.projection_groups(),
            decoder.num_layers,
            max_loras=max_loras,
            max_cpu_loras=max_cpu_loras,
            max_lora_rank=max_lora_rank,
            dtype=self.dtype,
            device=self.device,
        )
        return self.lora

    def _per_sequence_rope(self, cfg: PretrainedConfig) -> PerSequenceRotary | None:
        """The decoder's rotary module wrapped to run per regime of the step, where it is
        longrope (:mod:`.rope_spans`); None where it is not."""
        try:
            switch = longrope_switch(cfg)
        except ValueError as exc:
            raise UnsupportedModelError(f"rope_parameters: {exc}") from exc
        if switch is None:
            return None
        rotary = getattr(self.decoder, "rotary_emb", None)
        if not isinstance(rotary, torch.nn.Module):
            raise UnsupportedModelError(
                "rope_type 'longrope': its factors follow the sequence's length, and this "
                "model has no rotary_emb module to compute them per sequence"
            )
        wrapped = PerSequenceRotary(rotary, cfg, switch)
        self.decoder.rotary_emb = wrapped
        return wrapped

    def _probe_transformers_path(self, num_layers: int) -> None:
        """One forward pass of two tokens (into block 0's slots, which hold nothing yet):
        raises UnsupportedModelError where transformers' modules ask the paged attention for
        what it does not do, or where some layers do not attend through it."""
        tokens = min(2, self.block_size * self.num_blocks)
        blocks = list(range(-(-tokens // self.block_size)))
        meta = AttentionMetadata.build(
            [blocks], [tokens], [tokens], self.block_size, device=self.device
        )
        ctx = ForwardContext(self.kv_caches, meta, self.kernels)
        token = FORWARD_CONTEXT.set(ctx)
        try:
            with torch.inference_mode():
                self.decoder(
                    input_ids=torch.zeros((1, tokens), dtype=torch.long, device=self.device),
                    position_ids=torch.arange(tokens, device=self.device)[None],
                    use_cache=False,
                )
        except UnsupportedModelError:
            raise
        except Exception as exc:  # its attention does not go through the registry, or
            # expects what the paged path does not give it: refused, with what it said
            raise UnsupportedModelError(
                f"{type(self.model).__name__} (model_type {self.model.config.model_type!r}) "
                f"does not run on kvroute's paged attention: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            FORWARD_CONTEXT.reset(token)
        if ctx.calls != num_layers:
            types = getattr(self.model.config, "layer_types", None)
            raise UnsupportedModelError(
                f"{ctx.calls} of {num_layers} layers attend through kvroute's paged kernels "
                f"(layer_types {sorted(set(types)) if types else None}): the others attend "
                "by code of their own (an ALiBi bias, as Bloom's) or keep state the paged "
                "cache does not hold (linear attention, state-space layers)"
            )

    def _default_kv_budget(self, utilization: float) -> int:
        """CPU: 1 GiB. CUDA: as vLLM sizes it -- the card's share ``utilization`` minus
        what is already used (weights), less a margin for one step's activations."""
        if self.device.type != "cuda":
            return CPU_KV_CACHE_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(free - total * (1.0 - utilization)) - ACTIVATION_MARGIN_BYTES
        if budget <= 0:
            raise ValueError(
                f"no GPU memory left for the KV cache: {free / 2**30:.1f} GiB free of "
                f"{total / 2**30:.1f} GiB at gpu_memory_utilization={utilization}"
            )
        return budget

    @property
    def max_position_embeddings(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 20))

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding: a prompt token id must be below this."""
        return int(self.model.config.vocab_size)

    @property
    def logits_width(self) -> int:
        """Columns of the logits (the LM head's rows; may exceed the tokenizer's vocabulary)."""
        return int(self.lm_head.weight.shape[0])

    @property
    def medium(self) -> str:
        """The block events' name for this cache: "GPU", the engine's primary (device) tier,
        whatever the hardware, as vLLM names it on CPUs too; "CPU" names a host-memory tier
        beneath it, whose copies cost a load (issue 38), so a CPU engine must not use it."""
        return MEDIUM_GPU

    def prime(self, request_id: str, params: SamplingParams, draws: int) -> None:
        """A resumed request's generator skips the ``draws`` its earlier tokens took."""
        self.sampler.prime(request_id, params, draws, self.logits_width)

    def forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)

    def coefficients(
        self, name: str, max_batched_tokens: int, max_num_seqs: int
    ) -> CostCoefficients:
        """This runner's step-time model from its own model config and device (see
        :mod:`.cost_model`): what the replica reports to routers."""
        from .cost_model import CostModel, profile_for_model

        gpu = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        profile = profile_for_model(
            name=f"{name}@{gpu or 'cpu'}",
            config=self.model.config,
            num_params=self.num_params,
            dtype_bytes=torch.finfo(self.dtype).bits // 8,
            kv_tokens=self.num_blocks * self.block_size,
            max_batched_tokens=max_batched_tokens,
            max_num_seqs=max_num_seqs,
            device_name=gpu,
        )
        return CostModel(profile).coefficients()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> dict[str, SampledToken | RequestFailure]:
        """Computes every scheduled token's KV; samples for the requests that reach their end
        (a request whose own sampling failed gets a :class:`RequestFailure`)."""
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sample_reqs = []
        prompt_rows = []  # (request, its first row in the batch, first position, end position)
        for item in sched.scheduled:
            req = item.request
            start, end = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
            if req.prompt_logprobs is not None:
                # Position p gives prompt token p+1's entry; those a preempted request
                # recomputes are in already.
                first = max(start, len(req.prompt_logprobs) - 1)
                stop = min(end, req.num_prompt_tokens - 1)
                if first < stop:
                    prompt_rows.append((req, len(input_ids) + first - start, first, stop))
            input_ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
                sample_reqs.append(req)
        if not input_ids:
            return {}
        dev = self.device
        seq_lens = [item.num_computed_tokens + item.num_new_tokens for item in sched.scheduled]
        query_lens = [item.num_new_tokens for item in sched.scheduled]
        meta = AttentionMetadata.build(
            [item.block_ids for item in sched.scheduled],
            seq_lens,
            query_lens,
            self.block_size,
            device=dev,
        )
        ids = torch.tensor(input_ids, device=dev)
        pos = torch.tensor(positions, device=dev)
        lora = None
        if self.lora is not None:
            spans = [(_lora_key(s.request), s.num_new_tokens) for s in sched.scheduled]
            lora = self.lora.step(spans)
        if self.rope_spans is None:
            hidden = self._forward(ids, pos, meta, lora)
        else:
            self.rope_spans.step(
                [
                    (
                        item.num_computed_tokens,
                        item.num_new_tokens,
                        item.request.num_prompt_tokens,
                        item.num_tokens,
                    )
                    for item in sched.scheduled
                ]
            )
            try:
                hidden = self._forward(ids, pos, meta, lora)
            finally:
                self.rope_spans.done()
        out: dict[str, SampledToken | RequestFailure] = {}
        if sample_rows:
            logits = self.project_logits(hidden[torch.tensor(sample_rows, device=dev)])
            sampled = self.sampler.sample(
                logits,
                [r.request_id for r in sample_reqs],
                [r.sampling_params for r in sample_reqs],
                [(r.all_token_ids, r.output_token_ids) for r in sample_reqs],
                [r.grammar for r in sample_reqs],
            )
            out = {r.request_id: s for r, s in zip(sample_reqs, sampled, strict=True)}
        for req, row, first, stop in prompt_rows:
            try:
                self._prompt_logprobs(req, hidden, row, first, stop)
            except Exception as exc:  # this request's alone: the others' tokens stand
                out[req.request_id] = RequestFailure("prompt logprobs", exc)
        if self.lora is not None and self.lora.step_failures:
            for item in sched.scheduled:  # an adapter that failed its check: ran as the base
                err = self.lora.step_failures.get(_lora_key(item.request))
                if err is not None:
                    out[item.request.request_id] = RequestFailure("LoRA adapter", err)
        return out

    def _forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoRAStep | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [tokens, hidden]: a decode batch replayed
        from its graph where one fits (and no adapter is in it), else kvroute's decoder or
        transformers' modules."""
        if self.decode_graphs is not None and meta.max_query_len == 1 and lora is None:
            hidden = self.decode_graphs.run(ids, pos, meta)
            if hidden is not None:
                return hidden
        if self.paged_decoder is not None:
            return self.paged_decoder(ids, pos, self.kv_caches, meta, lora)
        token = FORWARD_CONTEXT.set(ForwardContext(self.kv_caches, meta, self.kernels))
        try:
            return self.decoder(
                input_ids=ids[None], position_ids=pos[None], use_cache=False
            ).last_hidden_state[0]
        finally:
            FORWARD_CONTEXT.reset(token)

    def _prompt_logprobs(
        self, req: Any, hidden: torch.Tensor, row: int, first: int, stop: int
    ) -> None:
        """Appends the entries of prompt tokens ``first + 1 .. stop`` to the request's."""
        k = req.sampling_params.prompt_logprobs
        ids = req.prompt_token_ids
        for lo in range(first, stop, PROMPT_LOGPROBS_ROWS):
            hi = min(lo + PROMPT_LOGPROBS_ROWS, stop)
            logits = self.project_logits(hidden[row + lo - first : row + hi - first])
            req.prompt_logprobs.extend(prompt_logprobs(logits, list(ids[lo + 1 : hi + 1]), k))


def _lora_key(req: Any) -> tuple[str, str] | None:
    """A request's adapter as the LoRA store names it; None for the base model."""
    return (req.lora_name, req.lora_path) if req.lora_name else None
