"""Per-step attention metadata that the model runner builds once and hands to every layer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["AttentionMetadata"]


@dataclass
class AttentionMetadata:
    """The index tensors of one engine step, shared by all layers.

    The host-side maxima travel with the tensors so that no layer needs a device sync to
    learn them. ``num_decodes`` is a hint: when the runner orders decodes first (as vLLM
    does), the first ``num_decodes`` sequences have exactly one new token.
    """

    slot_mapping: Tensor  # [num_tokens] int64, -1 for padding
    block_tables: Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: Tensor  # [num_seqs] int32, context length after this step
    query_start_loc: Tensor  # [num_seqs + 1] int32
    # Upper bounds the kernels may trust (the runner always sets them). None: not known
    # (callers with bare tensors): the reference then checks nothing against them and
    # Triton takes its large tile.
    max_query_len: int | None
    max_seq_len: int | None
    num_decodes: int | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def decode_only(self) -> bool:
        return self.max_query_len is not None and self.max_query_len <= 1

    @classmethod
    def of(
        cls,
        block_tables: Tensor,
        seq_lens: Tensor,
        query_start_loc: Tensor,
        *,
        max_query_len: int | None = None,
        max_seq_len: int | None = None,
        slot_mapping: Tensor | None = None,
    ) -> AttentionMetadata:
        """Metadata around index tensors a caller already has (tests, benchmarks, cascade
        attention), for ``paged_attention``, which reads neither ``slot_mapping`` (default:
        empty) nor ``num_decodes`` (None)."""
        if slot_mapping is None:
            slot_mapping = torch.empty(0, dtype=torch.int64, device=block_tables.device)
        return cls(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
        )

    @classmethod
    def build(
        cls,
        block_tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        block_size: int,
        *,
        num_padding_tokens: int = 0,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build the tensors from host lists in one place, so runner and tests agree on them.

        Sequence i's new tokens are at positions ``seq_lens[i] - query_lens[i]`` ..
        ``seq_lens[i] - 1``; their slots come from its block table. ``num_padding_tokens``
        extra slots of -1 are appended (a batch padded to a captured size).
        """
        if not len(block_tables) == len(seq_lens) == len(query_lens):
            raise ValueError("block_tables, seq_lens and query_lens differ in length")

        def i32(x: list[int] | list[list[int]]) -> Tensor:
            return torch.tensor(x, dtype=torch.int32, device=device)

        slots: list[int] = []
        for i, (table, s, q) in enumerate(zip(block_tables, seq_lens, query_lens, strict=True)):
            if not 0 <= q <= s or s > len(table) * block_size:
                raise ValueError(f"sequence {i}: query_len {q}, seq_len {s}, {len(table)} blocks")
            slots.extend(
                table[p // block_size] * block_size + p % block_size for p in range(s - q, s)
            )
        slots.extend([-1] * num_padding_tokens)
        width = max((len(t) for t in block_tables), default=0)
        padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
        tables = i32(padded) if padded else torch.zeros((0, 0), dtype=torch.int32, device=device)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1

        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=tables,
            seq_lens=i32(list(seq_lens)),
            query_start_loc=i32(starts),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            num_decodes=num_decodes,
        )
