"""Fleet: the replicas as one front door sees them -- membership, sockets, health, and the
feeds (KV events into the prefix index, load reports into the load view) routing reads.

One object per front door, used from one asyncio loop (the HTTP server's). The event
subscriber runs on its own thread and feeds :class:`PrefixIndex` (which locks); everything
else is touched only from the loop.

Why the shape:
- The fleet's :class:`BlockHasher` comes from the replicas' own :class:`ReplicaInfo`, and a
  replica whose hash config or model disagrees is refused: a router hashing differently
  from its engines silently gets 0% hits (docs/architecture.md, "Block hashing").
- Requests and deltas travel on the data plane (:class:`ReplicaConnection`, ZeroMQ, one
  message per replica step), never through Ray; Ray is discovery, restarts, load reports.
- A replica is lost when its connection drops or falls silent (the data plane notices),
  when a request's deltas say its engine failed, or when Ray's ``info()`` stops answering
  (the monitor). It is then unroutable, its index entries and load are dropped, and its
  in-flight requests fail over (:mod:`.request_run`).
- Replicas restart with new ports (Ray ``max_restarts``): the monitor polls ``info()`` and,
  on a new incarnation, drops what the index knew and follows the new endpoints.
- A replica whose data endpoint is ``http(s)://`` is a ``vllm serve`` kvroute did not
  start (``kvroute router --backend``): its connection is :mod:`.http_backend`'s, its
  control (the ``actor``) :mod:`.http_control`'s; everything else is the same.
- A replica whose engine hashes with an algorithm kvroute cannot reproduce (vLLM's default
  ``sha256``, reported as ``vllm:sha256``) is indexed by its events' token ids: an
  :class:`~kvroute.events.translate.EventTranslator` per such replica re-hashes each batch
  with the fleet's hasher before the index sees it, and is cleared whenever the index
  drops the replica. Only its block size (and model) must then agree with the fleet's.
  The fleet's hash is the first reproducible replica's, else ``xxh3_128``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.events import DEFAULT_SEED, BlockHasher, HashConfig, regime_salt, to_external
from kvroute.events.load import LoadReport
from kvroute.events.replica_api import ReplicaInfo
from kvroute.events.translate import TOKEN_INDEX_ALGO, EventTranslator, reproducible
from kvroute.events.transport import ReplicaBatch, ZmqEventSubscriber
from kvroute.events.wire import BlockStored

from ..backends.connection import HttpReplicaConnection
from ..backends.control import HttpBackend
from ..routing.index import PrefixIndex, prediction_stride
from ..routing.load import LoadTracker
from .fleet_monitor import FleetMonitor
from .replica_connection import ReplicaConnection

log = logging.getLogger(__name__)

PREPARE_TIMEOUT_S = 120.0  # longest a joining replica's preparation (its adapters) may take
# Summed into /metrics across a replica's subscriptions.
RETIRED_EVENT_FIELDS = ("delivered", "gaps", "malformed", "restarts", "resets")
HASH_MEMO = 1 << 14  # block hashes kept by what they hash (~0.5 kB each, sha256_cbor only)


class FleetMismatchError(ValueError):
    """A replica that cannot join this router's fleet (hash config or model differ)."""


@dataclass(slots=True)
class ReplicaHandle:
    """A replica as the front door uses it: its actor (control), its data-plane connection,
    its info, whether it is routable."""

    info: ReplicaInfo
    actor: Any
    alive: bool = True
    routed: int = 0  # kept across the replica's restarts, like every counter here
    failures: int = 0  # times it was found failed (by a request, its connection, the monitor)
    restarts: int = 0  # new incarnations the front door followed
    conn: ReplicaConnection | HttpReplicaConnection | None = None  # made at first use


class Fleet(FleetMonitor):
    """Replicas, their connections and health, the prefix index and the load view."""

    def __init__(
        self,
        replicas: Sequence[tuple[Any, ReplicaInfo]],
        *,
        monitor_interval_s: float = 2.0,
        load_interval_s: float = 0.2,
    ) -> None:
        if not replicas:
            raise ValueError("a front door needs at least one replica")
        first = replicas[0][1]
        self.model = first.model
        self.model_path = first.model_path
        self.max_model_len = min(info.max_model_len for _, info in replicas)
        # The fleet hashes as its first reproducible replica does; token-indexed replicas
        # are translated into that (a fleet of none hashes with xxh3_128, the fastest).
        ref = next((i for _, i in replicas if reproducible(i.hash_algo)), None)
        if ref is not None:
            self.hash_config: HashConfig = ref.hash_config
            self.hash_form = ref.hash_form
        else:
            self.hash_config = HashConfig(TOKEN_INDEX_ALGO, DEFAULT_SEED, first.block_size)
            self.hash_form = "bytes"
        # Prompts past a rotary switch hash with their own salt (hashing.regime_salt).
        self.long_prompt_after = first.long_prompt_after
        bs = self.hash_config.block_size
        # Shared prefixes are hashed request after request: their blocks' hashes are kept.
        self.hasher = BlockHasher(self.hash_config.algo, self.hash_config.seed, bs, memo=HASH_MEMO)
        self.index = PrefixIndex(prediction_stride=prediction_stride(bs))
        # Token-indexed replicas' translators (read where the subscriber runs).
        self.translators: dict[str, EventTranslator] = {}
        self.load = LoadTracker()
        self.replicas: dict[str, ReplicaHandle] = {}
        self.cordoned: set[str] = set()
        self.draining: set[str] = set()  # retiring (kvroute scale): cordoned, then gone
        # This front door's name on every replica's data plane (outputs come back to it).
        self.client_id = f"fd-{uuid.uuid4().hex[:12]}"
        self.subscriber = ZmqEventSubscriber(self._on_events)
        self._wrong_block_size: set[str] = set()  # replicas already reported for it
        self._block_size_ok: set[str] = set()  # streams whose block size was checked
        # Token ids to text (the front door's tokenizer): a resumed request's text held
        # back from the client, for HTTP backends (kvroute's replicas decode it themselves).
        self.decode: Callable[[list[int]], str] | None = None
        # This part's own error counts (the front door sums every part's for /metrics).
        self.errors: Counter[str] = Counter()
        # Event-stream counters of subscriptions already closed (replica restarts, losses).
        self.retired_event_stats: dict[str, Counter[str]] = {}
        self.monitor_interval_s = monitor_interval_s
        self.load_interval_s = load_interval_s
        # Called with a replica's id when what it held is dropped (the policy's own state).
        self.on_removed: list[Callable[[str], object]] = []
        # Awaited before a replica that joins or restarts is routed to (its LoRA adapters
        # put in place: router/lora/registry.py); a failure there is logged, not fatal.
        self.prepare: Callable[[Any, ReplicaInfo], Awaitable[None]] | None = None
        # Called with the number of replicas after one joined or was removed (joins and
        # removals at runtime: :class:`~.membership.Membership`).
        self.on_members: list[Callable[[int], object]] = []
        self._monitor: asyncio.Task[None] | None = None
        # Some replica prefills or decodes only (P/D): runs plan their parts
        # (routing/disagg.py). Kept as replicas come and go, read by every run.
        self.split_roles = False
        for actor, info in replicas:
            self.add(actor, info)

    # -- membership ------------------------------------------------------------------------
    def check(self, info: ReplicaInfo) -> None:
        """Raises :class:`FleetMismatchError` unless the replica hashes and serves as the
        fleet does (a token-indexed replica: unless its blocks are the fleet's size), and
        holds the fleet's longest request (the front door admits up to the shortest
        ``max_model_len`` it started with; a replica joining later may not lower it)."""
        if info.max_model_len < self.max_model_len:
            raise FleetMismatchError(
                f"replica {info.replica_id}: max_model_len {info.max_model_len} < the "
                f"fleet's {self.max_model_len}"
            )
        if not reproducible(info.hash_algo):
            if info.block_size != self.hasher.block_size:
                raise FleetMismatchError(
                    f"replica {info.replica_id}: its engine caches {info.block_size}-token "
                    f"blocks, the fleet hashes {self.hasher.block_size}-token ones; its "
                    "events (indexed by token ids) could never match a request"
                )
        elif why := self.hash_config.mismatch(info.hash_config):
            raise FleetMismatchError(f"replica {info.replica_id}: hash config differs ({why})")
        elif info.hash_form != self.hash_form:
            raise FleetMismatchError(
                f"replica {info.replica_id}: hash form {info.hash_form!r} != {self.hash_form!r}"
            )
        if info.model != self.model:
            raise FleetMismatchError(
                f"replica {info.replica_id}: model {info.model!r} != fleet's {self.model!r}"
            )
        if info.long_prompt_after != self.long_prompt_after:
            raise FleetMismatchError(
                f"replica {info.replica_id}: salts prompts past {info.long_prompt_after} "
                f"tokens, the fleet past {self.long_prompt_after} (hashing.regime_salt)"
            )

    def add(self, actor: Any, info: ReplicaInfo) -> None:
        """Follows the replica's events (a snapshot first) and makes it routable."""
        self.check(info)
        rid = info.replica_id
        old = self.replicas.get(rid)
        if old is not None:
            self._forget(rid)
        rep = self.replicas[rid] = ReplicaHandle(info, actor)
        self._roles_changed()
        if info.draining:  # found while it retires: never routed to
            self.draining.add(rid)
            self.cordoned.add(rid)
        elif rid in self.draining:  # a new process under a retired one's name
            self.draining.discard(rid)
            self.cordoned.discard(rid)
        if old is not None:  # a restart: its counters go on from where they were
            rep.routed, rep.failures = old.routed, old.failures
            rep.restarts = old.restarts + (info.incarnation != old.info.incarnation)
        if info.cost is not None:  # priced in its own seconds; else the policy's reference
            self.load.register(rid, info.cost, info.num_blocks)
        if reproducible(info.hash_algo):
            self.translators.pop(rid, None)
        else:
            if rid not in self.translators:  # one line per replica, on the console too
                log.warning(
                    "replica %s hashes with %s, which kvroute cannot reproduce: indexed by "
                    "its events' token ids, re-hashed with the fleet's %s (vLLM's "
                    "sha256_cbor would spare the router that work)",
                    rid, info.hash_algo, self.hash_config.algo,
                )  # fmt: skip
            self.translators[rid] = EventTranslator(
                self.hasher, self.hash_form, self.index.max_blocks_per_replica
            )
        self.subscriber.add_publisher(rid, info.events_endpoint, info.replay_endpoint, info.topic)
        log.info("replica %s (incarnation %s) added", rid, info.incarnation[:8])

    async def join(self, actor: Any, info: ReplicaInfo | None = None) -> str:
        """A replica that joins a running fleet (scale-up): prepared (:attr:`prepare`),
        then added and routable. Returns its id."""
        if info is None:
            info = await actor.info.remote()
        self.check(info)
        await self._prepare(actor, info)
        self.add(actor, info)
        self.connection(info.replica_id)
        self._members_changed()
        return info.replica_id

    def remove(self, rid: str) -> None:
        """The replica is gone for good (retired by ``kvroute scale``, or its actor killed):
        forgotten, not waited for. Its requests, if any were left, fail over."""
        rep = self.replicas.get(rid)
        if rep is None:
            return
        if rep.alive:
            rep.alive = False
            self._forget(rid)
        if rep.conn is not None:
            rep.conn.close()
        del self.replicas[rid]
        self._roles_changed()
        self.cordoned.discard(rid)
        retired = rid in self.draining
        self.draining.discard(rid)
        self.load.forget(rid)
        self.translators.pop(rid, None)
        log.warning("replica %s %s", rid, "retired" if retired else "removed from the fleet")
        self._members_changed()

    def _roles_changed(self) -> None:
        self.split_roles = any(r.info.role != "both" for r in self.replicas.values())

    def _members_changed(self) -> None:
        for callback in self.on_members:
            callback(len(self.replicas))

    def _rejoin(self, rid: str, actor: Any, info: ReplicaInfo) -> None:
        """A restarted replica joins again (the monitor's call), or is failed when its
        configuration no longer matches the fleet's."""
        try:
            self.add(actor, info)
        except FleetMismatchError as exc:
            log.error("%s", exc)
            self.fail(rid)

    async def _prepare(self, actor: Any, info: ReplicaInfo) -> None:
        if self.prepare is None:
            return
        try:  # bounded: the monitor's poll awaits it, and a replica may hang
            await asyncio.wait_for(self.prepare(actor, info), PREPARE_TIMEOUT_S)
        except Exception:
            self.errors["prepare_failed"] += 1
            log.exception("replica %s: preparing it failed", info.replica_id)

    def connection(self, rid: str) -> ReplicaConnection | HttpReplicaConnection:
        """The replica's data-plane connection, made at first use (on the running loop)."""
        rep = self.replicas[rid]
        conn = rep.conn
        if conn is not None and conn.lost is None:
            return conn
        info = rep.info
        if info.data_endpoint.startswith(("http://", "https://")):
            conn = rep.conn = HttpReplicaConnection(
                rid,
                info.data_endpoint,
                info.incarnation,
                info.model,
                self._on_lost,
                decode=self.decode,
            )
        else:
            conn = rep.conn = ReplicaConnection(
                rid,
                info.data_endpoint,
                info.incarnation,
                self.client_id,
                self._on_lost,
                on_load=self._on_load,
            )
        return conn

    def _on_events(self, item: ReplicaBatch) -> None:
        """Where the subscriber runs (the loop, once started): into the index, unless the
        engine's blocks are not the size this fleet hashes (its events would never match a
        request: said, not indexed). An engine's block size is fixed, so each stream's
        first BlockStored is checked and the rest go straight to the index (this is the
        event-ingest path)."""
        rid = item.replica_id
        if rid not in self._block_size_ok:
            size = self.hasher.block_size
            stored = next((ev for ev in item.batch.events if isinstance(ev, BlockStored)), None)
            if stored is None:
                pass  # nothing to judge by yet
            elif stored.block_size == size:
                self._block_size_ok.add(rid)
            else:
                self.errors["block_size_mismatch"] += 1
                if rid not in self._wrong_block_size:
                    self._wrong_block_size.add(rid)
                    log.error(
                        "replica %s publishes %d-token blocks, the fleet hashes %d-token "
                        "ones: its events are not indexed (is its events endpoint another "
                        "server's?)", rid, stored.block_size, size,
                    )  # fmt: skip
                return
        # Set before a token-indexed replica's subscription starts (so the index never sees
        # an engine's own hashes); unset only when it comes back reproducible.
        tr = self.translators.get(rid)
        if tr is not None:
            batch = tr.translate(item.batch, snapshot=item.source == "snapshot")
            item = ReplicaBatch(rid, item.seq, batch, item.source)
        self.index.on_batch(item)

    def _on_load(self, rid: str, report: LoadReport) -> None:
        rep = self.replicas.get(rid)
        if rep is not None and rep.alive:
            self.load.report(rid, report, time.monotonic())

    def _on_lost(self, rid: str, why: str) -> None:
        if rid not in self.draining:
            self.errors["connection_lost"] += 1
        self.fail(rid)

    def _forget(self, rid: str) -> None:
        """Its cache is gone or out of reach: unsubscribe and drop what the index held for it
        (whatever the policy: /metrics and any later policy read the same index)."""
        self._block_size_ok.discard(rid)  # a new stream (a restart, maybe reconfigured)
        self._wrong_block_size.discard(rid)
        stats = self.subscriber.stats().get(rid)
        if stats is not None:  # a new subscription starts at zero: keep the totals
            total = self.retired_event_stats.setdefault(rid, Counter())
            total.update({f: getattr(stats, f) for f in RETIRED_EVENT_FIELDS})
            total["resets"] += 1  # its indexed state is dropped now, rebuilt when it is back
        with contextlib.suppress(RuntimeError):
            self.subscriber.remove_publisher(rid)
        rep = self.replicas.get(rid)
        if rep is not None and rep.conn is not None:  # its requests fail over now
            rep.conn.mark_lost("dropped by the front door", notify=False)
        self.index.drop_replica(rid)
        tr = self.translators.get(rid)
        if tr is not None:  # a later subscription to it starts from an empty map
            tr.clear()
        for callback in self.on_removed:
            callback(rid)

    def fail(self, rid: str) -> None:
        """The replica failed: stop routing to it until the monitor sees it back."""
        rep = self.replicas.get(rid)
        if rep is None or not rep.alive:
            return
        if rid in self.draining:  # retired as planned (kvroute scale), not failed
            self.remove(rid)
            return
        rep.alive = False
        rep.failures += 1
        self.errors["replica_failure"] += 1
        self._forget(rid)
        log.warning("replica %s failed; not routing to it until it is back", rid)

    def mark_routed(self, rid: str) -> None:
        """A request routed to ``rid`` got its first delta there (``routed`` in /metrics
        and /fleet counts those, kept across the replica's restarts)."""
        rep = self.replicas.get(rid)
        if rep is not None:
            rep.routed += 1

    def role(self, rid: str) -> str:
        """The replica's P/D role ("prefill", "decode" or "both"; routing/disagg.py)."""
        rep = self.replicas.get(rid)
        return rep.info.role if rep is not None else "both"

    def fetch_endpoint(self, rid: str) -> str:
        """The replica's transfer plane, which a prefix fetch pulls from ("": none, or gone;
        routing/fetch.py). Only an alive replica's: a pull from a dead one would wait out
        its deadline."""
        rep = self.replicas.get(rid)
        if rep is None or not rep.alive:
            return ""
        return rep.info.kv_transfer_endpoint or ""

    def vocab_size(self) -> int | None:
        """The fleet's smallest vocabulary (None: no replica says): a token id past it
        would fail on some replica."""
        sizes = [r.info.vocab_size for r in self.replicas.values() if r.info.vocab_size]
        return min(sizes, default=None)

    def alive(self) -> list[str]:
        return [rid for rid, r in self.replicas.items() if r.alive]

    def routable(self, exclude: Collection[str] = ()) -> list[str]:
        """Live, uncordoned replicas, less ``exclude``."""
        return [
            rid
            for rid, r in self.replicas.items()
            if r.alive and rid not in self.cordoned and rid not in exclude
        ]

    def cordon(self, rid: str, cordoned: bool = True) -> None:
        """Stop (or resume) routing new requests to a live replica, e.g. to drain it before
        maintenance; requests already there run to their end."""
        if rid not in self.replicas:
            raise KeyError(rid)
        (self.cordoned.add if cordoned else self.cordoned.discard)(rid)

    def block_hashes(
        self,
        prompt_token_ids: Sequence[int],
        salt: str,
        lora_name: str | None = None,
        lora_path: str | None = None,
    ) -> list[Any]:
        """The prompt's block hashes as the replicas publish them; ``lora_name`` and its
        ``lora_path`` (as the replicas registered it): the adapter it runs under, which is
        in every block's hash."""
        form = self.hash_form
        salted = regime_salt(salt, len(prompt_token_ids), self.long_prompt_after)
        if lora_name is None:
            hashes = self.hasher.hash_blocks(prompt_token_ids, cache_salt=salted)
        else:
            hashes = self.hasher.hash_blocks(
                prompt_token_ids, cache_salt=salted, lora_name=lora_name, lora_path=lora_path
            )
        if form == "bytes":  # events carry the digests themselves
            return hashes
        return [to_external(h, form) for h in hashes]  # type: ignore[arg-type]

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Connects to every replica's data plane and starts the monitor on the running loop,
        where the event subscriber moves too (each step's events and outputs then wake one
        thread, not two)."""
        self.subscriber.attach(asyncio.get_running_loop())
        for rid, rep in self.replicas.items():
            if rep.alive:
                self.connection(rid)
        if self._monitor is None:
            self._monitor = asyncio.get_running_loop().create_task(self._watch())

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        for rep in self.replicas.values():
            if rep.conn is not None:
                rep.conn.close()
            if isinstance(rep.actor, HttpBackend):  # its control client
                await rep.actor.aclose()
        self.subscriber.close()
