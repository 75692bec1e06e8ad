"""KV that moves between replicas: the messages of a handoff (prefill on one replica, decode
on another) and of the transfer plane that carries the blocks.

Why a contract of its own: three parties speak it. The replica that computed a prompt
(the *source*) leases its blocks and says so in its first delta (:class:`KVHandoff`); the
front door passes that on to the replica that continues the request (:class:`KVSource`,
in its ``GenerateRequest``); that replica pulls the blocks straight from the source over
the transfer plane (:class:`Pull`, answered by :class:`BlockHeader` frames and a
:class:`PullEnd`). The router imports the first two; only replicas speak the plane.

How blocks are named: by position in the source's lease and by hash. A puller asks for
``hashes[start:start + n]`` of a lease and the source serves exactly the hashes it leased
at those positions, or ends the pull with a reason. A hash chain folds in the tenant's
cache salt and the adapter, so a puller whose request is another tenant's (or another
adapter's) names hashes the lease does not hold, and gets nothing.

What a failed transfer costs: never a wrong token. Every block carries an xxh3-64 of its
bytes; the puller stops at the first block that is missing, late, short or fails its
checksum, and recomputes from there, as after a failed lower-tier load.
"""

from __future__ import annotations

from typing import Any

import msgspec

# The medium a request's blocks came from when another replica sent them: a key of
# ``num_tier_cached_tokens`` beside "CPU" and "STORAGE". Never in a KV event: the blocks a
# pull lands are published as the puller's own (``BlockStored`` GPU).
MEDIUM_REMOTE = "REMOTE"

# How long a source holds a handoff's blocks for its puller (vLLM's NixlConnector lease,
# ``kv_lease_duration``, is 30 s), unless the puller asks to keep them longer.
DEFAULT_LEASE_S = 30.0

# Why a pull ended (PullEnd.reason).
PULL_OK = "ok"
PULL_UNKNOWN = "unknown"  # no such lease: never granted, released, expired or revoked
PULL_MISMATCH = "mismatch"  # the hashes asked for are not the lease's at those positions
PULL_FAILED = "failed"  # the source could not read a block


class KVHandoff(msgspec.Struct, kw_only=True, frozen=True):
    """A source's lease on a prompt's blocks, in the delta that ends its part of a
    request (``finish_reason="handoff"``): the front door continues the request elsewhere
    and hands this on as a :class:`KVSource`."""

    replica_id: str
    endpoint: str  # the source's transfer plane ("" where blocks are not served over one)
    lease: bytes  # 16 random bytes: only a holder of the delta can name these blocks
    num_blocks: int  # the prompt's full blocks leased, from its first
    expires_in_s: float  # unless kept (:class:`Keep`) or released first
    # A vLLM engine's handoff (its NixlConnector): the ``kv_transfer_params`` its prefill
    # returned, passed to the decode engine as they are; then the first token is the
    # decode's to make and the delta carries none (:func:`vllm_prefill_params`).
    kv_transfer_params: dict[str, Any] | None = None


class KVSource(msgspec.Struct, kw_only=True, frozen=True):
    """Where a request's prompt blocks can be pulled from (``GenerateRequest.kv_source``):
    the first ``num_blocks`` of its chain, under ``lease``. The puller skips what it holds."""

    replica_id: str
    endpoint: str
    lease: bytes
    num_blocks: int
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's (see KVHandoff)

    @classmethod
    def of(cls, handoff: KVHandoff) -> KVSource:
        return cls(
            replica_id=handoff.replica_id,
            endpoint=handoff.endpoint,
            lease=handoff.lease,
            num_blocks=handoff.num_blocks,
            kv_transfer_params=handoff.kv_transfer_params,
        )


def vllm_prefill_params() -> dict[str, Any]:
    """The ``kv_transfer_params`` that make a vLLM engine (NixlConnector) run a request as
    the prefill half of a pair, as vLLM's P/D proxy and llm-d's sidecar send them (with
    ``max_tokens`` 1 and no stream). Its answer's ``kv_transfer_params`` (``remote_block_ids``,
    ``remote_engine_id``, ``remote_request_id``, ``remote_host``, ``remote_port``,
    ``tp_size``, ...) go, as they are, with the decode request: that engine pulls the blocks
    and computes the first token again (the prefill's is dropped)."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def vllm_handoff(replica_id: str, params: dict[str, Any] | None) -> KVHandoff | None:
    """The handoff a vLLM prefill's answer makes: its ``kv_transfer_params`` to pass on
    (``remote_block_ids``: one list per KV-cache group in vLLM 0.32, a flat list before).
    None where it gave none (no connector, or a failure): the decode side runs it whole."""
    if not params:
        return None
    blocks = params.get("remote_block_ids") or ()
    if blocks and isinstance(blocks[0], list | tuple):
        blocks = blocks[0]
    return KVHandoff(
        replica_id=replica_id,
        endpoint="",
        lease=b"",
        num_blocks=max(len(blocks), 1),  # never 0: the front door passes a source on
        expires_in_s=VLLM_LEASE_S,
        kv_transfer_params=params,
    )


# NixlConnector's ``kv_lease_duration`` default (vLLM 0.32): how long a prefill engine holds
# the blocks for the decode engine's pull; only informative to the front door.
VLLM_LEASE_S = 30.0


# -- the transfer plane (puller DEALER -> source ROUTER, msgpack; kind byte first) --------
KIND_PULL = b"P"
KIND_BLOCK = b"B"
KIND_END = b"E"
KIND_KEEP = b"K"
KIND_DONE = b"D"


class Pull(msgspec.Struct, kw_only=True, frozen=True):
    """Asks for ``hashes``, the lease's blocks from position ``start`` on."""

    pull_id: int
    lease: bytes
    start: int
    hashes: list[bytes]


class BlockHeader(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """Precedes one block's bytes (the next frame): its position in the pull, its size and
    the xxh3-64 of its bytes."""

    pull_id: int
    index: int
    nbytes: int
    digest: int


class PullEnd(msgspec.Struct, kw_only=True, frozen=True):
    """Ends a pull: how many blocks were sent, and why no more."""

    pull_id: int
    sent: int
    reason: str


class Keep(msgspec.Struct, kw_only=True, frozen=True):
    """The puller still wants the lease (its request waits in a queue): hold it this much
    longer than now."""

    lease: bytes
    extend_s: float


class Done(msgspec.Struct, kw_only=True, frozen=True):
    """The puller has what it needs (or gave up): the source frees the lease now."""

    lease: bytes
