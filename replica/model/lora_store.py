"""Where an engine's LoRA adapters live: registered, in host memory, in device slots.

Three tiers, as vLLM's (``--max-loras``, ``--max-cpu-loras``):

- registered: name -> folder, checked when registered (:func:`~.lora.inspect_adapter`:
  config and tensor shapes; a bad adapter is refused then, not when a request needs it);
  an adapter whose read fails later (its file rewritten at another rank, truncated, or
  hung) is unavailable here until registered again: its requests fail with the reason,
  as a 400, and the engine steps on for everyone else;
- host memory: up to ``max_cpu_loras`` adapters read into memory, least recently used
  out first (never a running request's; an idle one in a slot goes, its slot with it);
- device slots: ``max_loras`` rows of stacked weight tensors per layer and projection,
  which the grouped kernels (:mod:`kvroute.kernels.lora`) index by slot. One step mixes at
  most ``max_loras`` adapters (the scheduler's rule); a step that needs an adapter not in
  a slot copies it from host memory into the least recently used slot it does not need.

Why reads run on a thread of their own: reading an adapter from disk takes as long as its
file is large -- forever, on a hung mount -- and the engine's step must not wait for it
while other requests are ready. :meth:`LoRAStore.ready` answers the scheduler at once (and
starts the read, under a deadline: :mod:`.lora_reads`); the request waits in the queue, not
the step. What a read brings is checked against the registration before it is kept, and
again before a slot is written (:meth:`LoRAStore._check`), so no adapter's shape can raise
on the step. A slot copy is a memory copy of one adapter, done on the step that first
needs it.

Slot tensors are sized for the adapters they have held: the largest rank so far, and per
layer and projection the span of targets any of them had (an adapter of q and v also
computes a zero k, so that the fused QKV output is added to in one piece). They grow,
copying the slotted adapters over, when an adapter needs more; they never shrink.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvroute.kernels.lora import LoRAMapping, add_lora, kernel_for

from .lora_adapter import (
    AdapterSpec,
    LoRAAdapter,
    LoRAError,
    ProjectionGroup,
    inspect_adapter,
    load_adapter,
)
from .lora_reads import READ_TIMEOUT_S, AdapterReads

log = logging.getLogger(__name__)

LoRAKey = tuple[str, str]  # (name, path): a name re-registered elsewhere is another adapter


@dataclass(slots=True)
class _GroupSlots:
    """One layer's projection group in every slot: targets ``lo .. hi - 1`` of the group,
    whose outputs are columns ``col_lo .. col_hi - 1`` of the fused projection."""

    a: Tensor  # [slots, in, targets * rank]
    bs: list[Tensor]  # per target [slots, rank, out_t]
    targets: tuple[str, ...]
    col_lo: int
    col_hi: int
    full: bool  # the span is the whole fused output


@dataclass(slots=True)
class LoRAStep:
    """One step's adapters: the slots' weights and which rows use which slot."""

    layers: list[list[_GroupSlots | None]]
    mapping: LoRAMapping

    def add(self, layer: int, group: int, x: Tensor, y: Tensor) -> None:
        """Adds the LoRA products of projection ``group`` of ``layer`` (input ``x``) to its
        output ``y`` in place, on the rows that use an adapter."""
        g = self.layers[layer][group]
        if g is not None:
            out = y if g.full else y[:, g.col_lo : g.col_hi]
            add_lora(out, x, g.a, g.bs, self.mapping)


@dataclass
class LoRAStats:
    loads: int = 0  # adapters read from disk
    slot_loads: int = 0  # adapters copied into a slot
    host_evictions: int = 0
    resizes: int = 0  # slot tensors grown
    load_seconds: float = 0.0  # reading adapters from disk, in total (on the loader threads)
    read_failures: int = 0  # reads that failed, timed out or brought a changed adapter


class LoRAStore:
    """An engine's adapters: registry, host LRU, device slots (the module docstring)."""

    def __init__(
        self,
        groups: Sequence[ProjectionGroup],
        num_layers: int,
        *,
        max_loras: int,
        max_cpu_loras: int | None,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        read_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        max_cpu = max_loras if max_cpu_loras is None else max_cpu_loras
        if max_cpu < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu}) must be >= max_loras ({max_loras})")
        if not 1 <= max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be in 1..512, got {max_lora_rank}")
        self.groups = list(groups)
        self.num_layers = num_layers
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.device = device
        self.kernel = kernel_for(device)
        self._shapes: dict[str, tuple[int, int]] = {}
        for g in self.groups:
            self._shapes.update(g.shapes())
        self._registry: dict[str, AdapterSpec] = {}
        self._host: OrderedDict[LoRAKey, LoRAAdapter] = OrderedDict()  # oldest use first
        self._loading: dict[LoRAKey, cf.Future[LoRAAdapter]] = {}
        self._failed: dict[LoRAKey, Exception] = {}  # not yet taken by the engine
        self._broken: dict[LoRAKey, LoRAError] = {}  # unavailable until registered again
        # A few readers, each read under a deadline: one large, slow or hung adapter must
        # not hold up the reads of others, nor the step.
        self.reads = AdapterReads(read_timeout_s)
        self.step_failures: dict[LoRAKey, LoRAError] = {}  # the last step's (see step)
        self._slots: list[LoRAKey | None] = [None] * max_loras
        self._slot_use: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))
        self._rank = 0
        self._keys: set[tuple[int, str]] = set()  # (layer, target) the slot tensors cover
        self._layers: list[list[_GroupSlots | None]] = [
            [None] * len(self.groups) for _ in range(num_layers)
        ]
        self._pinned: set[LoRAKey] = set()  # adapters of running requests
        self._claimed: set[LoRAKey] = set()  # said ready since the last pin: maybe admitted
        self.stats = LoRAStats()

    # -- registry ----------------------------------------------------------------------
    def inspect(self, path: str) -> cf.Future[AdapterSpec]:
        """Checks an adapter folder on a reader thread, under the deadline: what
        :meth:`register` takes, so that the engine's thread never reads the folder."""
        return self.reads.submit(f"LoRA adapter folder {path}", functools.partial(
            inspect_adapter, path, self._shapes, self.num_layers, self.max_lora_rank
        ))  # fmt: skip

    def register(self, name: str, path: str, spec: AdapterSpec | None = None) -> AdapterSpec:
        """Names the adapter ``spec`` (:meth:`inspect`'s; None: inspected now, waiting for
        it under the deadline); LoRAError says what it cannot serve. Registering again
        makes an adapter that failed here available again, and what is in memory of it
        is dropped (unless requests run on it): it is read anew, as registered now."""
        if not name:
            raise LoRAError("lora_name must not be empty")
        old = self._registry.get(name)
        if old is not None and old.path != str(path):
            raise LoRAError(f"LoRA adapter {name!r} is already registered from {old.path}")
        if spec is None:
            spec = self.inspect(str(path)).result()
        self._registry[name] = spec
        key = (name, spec.path)
        self._broken.pop(key, None)
        if key not in self._pinned and key not in self._claimed:
            self._loading.pop(key, None)  # a read begun before: its result is not wanted
            self._evict(key)
        return spec

    def unavailable(self, name: str, path: str) -> LoRAError | None:
        """Why the registered adapter cannot serve requests here (a read of it failed since
        it was registered); None when it can."""
        return self._broken.get((name, path))

    def unregister(self, name: str) -> bool:
        """Forgets a name: new requests cannot use it; requests already queued or running
        keep their adapter (their key holds its path) until they end."""
        spec = self._registry.pop(name, None)
        if spec is None:
            return False
        key = (name, spec.path)
        self._broken.pop(key, None)
        if key not in self._slots and key not in self._pinned:
            self._host.pop(key, None)
        return True

    def path_of(self, name: str) -> str:
        """The registered folder of an adapter; ValueError for a name not registered."""
        spec = self._registry.get(name)
        if spec is None:
            raise ValueError(f"unknown LoRA adapter {name!r} (lora_name)")
        return spec.path

    def registered(self) -> dict[str, str]:
        return {name: spec.path for name, spec in self._registry.items()}

    def resident(self) -> list[str]:
        """Names of the adapters in device slots now."""
        return [k[0] for k in self._slots if k is not None]

    def residency(self, running: Collection[str] = ()) -> dict[str, Any]:
        """What routers are told (``LoadReport``'s ``lora_*`` fields): the adapters in
        slots and in host memory, the free slots, and ``running`` (the running requests'
        adapters: their slots cannot be given up). Residency, not recent use: a name is
        listed while its weights are there, whether or not a request used it lately."""
        slotted = [k for k in self._slots if k is not None]
        return {
            "lora_slots": self.max_loras,
            "lora_free_slots": self.max_loras - len(slotted),
            "lora_resident": tuple(k[0] for k in slotted),
            "lora_running": tuple(sorted(running)),
            "lora_host": tuple(k[0] for k in self._host),
            "lora_read_failures": self.stats.read_failures,
            "lora_reads_hung": self.reads.hung,
        }

    def measure_load(self, name: str) -> tuple[float, float]:
        """(host -> slot, disk -> host) seconds of one load of the registered adapter
        ``name``, timed now (at start, so routers can price a load on this replica): read
        from disk into host memory, then copied into a slot (the copy timed alone, after
        the slot tensors are sized for it). Then both are given up again: what a request
        later uses is read when it needs it, from the file as it is then."""
        key = (name, self.path_of(name))
        if key in self._host or key in self._slots or self._pinned:
            raise RuntimeError("measure_load is for an engine that served nothing yet")
        t0 = time.perf_counter()
        what = f"LoRA adapter {name!r} ({key[1]})"
        adapter = self.reads.result(what, lambda: self._read(name, key[1], self._registry[name]))
        read_s = time.perf_counter() - t0
        self.stats.loads -= 1  # a measurement, not a load a request needed
        self._host[key] = adapter
        slot = self._activate(key, {key})
        self.stats.slot_loads -= 1
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t1 = time.perf_counter()
        self._copy_into(slot, adapter)
        sync()
        load_s = time.perf_counter() - t1
        self._slots[slot] = None
        del self._host[key]
        return load_s, read_s

    # -- host memory -------------------------------------------------------------------
    def ready(self, name: str, path: str) -> bool:
        """True when the adapter is in memory (a step can use it now); else starts reading
        it on a reader thread, if not under way, and says False. Never waits."""
        key = (name, path)
        if key in self._host:
            self._host.move_to_end(key)
            self._claimed.add(key)
            return True
        if key in self._broken:
            return False  # its requests fail (take_failures), new ones are refused
        fut = self._loading.get(key)
        if fut is None:
            spec = self._registry.get(name)
            if spec is None or spec.path != path:
                spec = None  # unregistered since: inspect it again on the thread
            read = functools.partial(self._read, name, path, spec)
            self._loading[key] = self.reads.submit(f"LoRA adapter {name!r} ({path})", read)
            return False
        if fut.done() and self._settle(key):
            self._claimed.add(key)
            return True
        return False

    def _settle(self, key: LoRAKey) -> bool:
        """A finished read: its adapter kept in memory (True), or its failure recorded."""
        try:
            adapter = self._loading.pop(key).result()
            self._check(adapter)
        except Exception as exc:
            self._fail(key, exc)
            return False
        self._host[key] = adapter
        self._trim_host()
        return True

    def _fail(self, key: LoRAKey, exc: Exception) -> None:
        """The adapter is unavailable here until registered again; its waiting requests
        fail with ``exc`` (one line, naming it) at the engine's next take_failures."""
        name, path = key
        log.error("LoRA adapter %r from %s: %s", name, path, exc)
        if isinstance(exc, LoRAError):  # what the client reads: the folder is the server's
            text = str(exc).replace(path, "<adapter folder>")
        else:
            text = f"LoRA adapter {name!r} failed to load ({type(exc).__name__})"
        err = LoRAError(f"{text}; it is unavailable on this replica until it is loaded again")
        self.stats.read_failures += 1
        self._failed[key] = self._broken[key] = err
        self._evict(key)

    def _read(self, name: str, path: str, spec: AdapterSpec | None) -> LoRAAdapter:
        """On a reader thread: the adapter read and checked against its registration."""
        t0 = time.perf_counter()
        if spec is None:
            spec = inspect_adapter(path, self._shapes, self.num_layers, self.max_lora_rank)
        adapter = load_adapter(name, spec, self.dtype)
        self._check(adapter)
        self.stats.loads += 1
        self.stats.load_seconds += time.perf_counter() - t0
        return adapter

    def _check(self, adapter: LoRAAdapter) -> None:
        """LoRAError unless every weight has the shape and dtype the slots take: a weight
        that does not must never reach :meth:`_copy_into` (it would raise on the step)."""
        spec, name = adapter.spec, adapter.name
        same_keys = adapter.weights.keys() == spec.tensors.keys()
        if not 1 <= spec.rank <= self.max_lora_rank or not same_keys:
            raise LoRAError(f"LoRA adapter {name!r}: its weights do not match its registration")
        for (layer, target), (a, b) in adapter.weights.items():
            if target not in self._shapes or not 0 <= layer < self.num_layers:
                raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {target} is not served")
            fan_in, fan_out = self._shapes[target]
            want = ((fan_in, spec.rank), (spec.rank, fan_out))
            if (tuple(a.shape), tuple(b.shape)) != want or {a.dtype, b.dtype} != {self.dtype}:
                raise LoRAError(
                    f"LoRA adapter {name!r}: layer {layer} {target} has weights "
                    f"{list(a.shape)} x {list(b.shape)} ({a.dtype}), the slots take "
                    f"{list(want[0])} x {list(want[1])} ({self.dtype})"
                )

    def take_failures(self) -> dict[LoRAKey, Exception]:
        """Adapters whose read failed since the last call (their requests cannot run); a
        read that ended meanwhile is settled first, so a failure is never left unseen."""
        for key in [k for k, fut in self._loading.items() if fut.done()]:
            self._settle(key)
        failed, self._failed = self._failed, {}
        return failed

    def loading(self) -> bool:
        return bool(self._loading)

    def wait(self, timeout: float) -> None:
        """Blocks until a read under way ends, ``timeout`` at most (an idle engine's wait)."""
        if self._loading:
            cf.wait(list(self._loading.values()), timeout, cf.FIRST_COMPLETED)

    def _trim_host(self, keep: Collection[LoRAKey] = ()) -> None:
        """Host memory back to ``max_cpu_loras``, least recently used out first, never a
        running request's adapter nor one of ``keep``. An idle adapter in a slot may go
        too (its slot with it): an adapter just read must stay until its request is
        admitted, since nothing is read on the step any more."""
        keep = self._pinned.union(self._claimed, keep)
        for key in list(self._host):
            if len(self._host) <= self.max_cpu_loras:
                return
            if key not in keep:
                self._evict(key)
                self.stats.host_evictions += 1

    def _evict(self, key: LoRAKey) -> None:
        """Out of host memory, and out of its slot if it has one."""
        self._host.pop(key, None)
        if key in self._slots:
            self._slots[self._slots.index(key)] = None

    def pin(self, keys: set[LoRAKey]) -> None:
        """The adapters of the running requests (the engine's, each step): kept in host
        memory, and their slots given up last, so a running request that sits out a step
        never finds its adapter gone. Called before the step's reads are settled."""
        self._pinned, self._claimed = keys, set()

    # -- device slots ------------------------------------------------------------------
    def step(self, requests: Sequence[tuple[LoRAKey | None, int]]) -> LoRAStep | None:
        """The step's mapping, its adapters copied into slots as needed. ``requests``: each
        scheduled request's adapter key (None: the base model) and token count, in batch
        order. None when no request uses an adapter."""
        needed = {key for key, _ in requests if key is not None}
        self.step_failures = {}
        if not needed:
            return None
        if len(needed) > self.max_loras:
            raise RuntimeError(
                f"{len(needed)} LoRA adapters in one step, max_loras is {self.max_loras}"
            )
        slot_of = {key: s for s, key in enumerate(self._slots) if key in needed}
        for key in needed - slot_of.keys():
            try:
                slot_of[key] = self._activate(key, needed)
            except LoRAError as exc:  # checked before any slot changed: its requests alone
                self.step_failures[key] = exc
                if key in self._host:  # its weights failed the check: unavailable here
                    self._fail(key, exc)
                else:  # admitted, then gone from memory: a bookkeeping fault, not the file's
                    log.error("%s", exc)
        for s in slot_of.values():
            self._slot_use.move_to_end(s)
        spans: list[tuple[int, int, int]] = []
        row = 0
        for key, count in requests:
            if key is not None and key in slot_of:
                spans.append((slot_of[key], row, count))
            row += count
        mapping = LoRAMapping.build(spans, self.max_loras, self.device, self.kernel, self.dtype)
        return None if mapping is None else LoRAStep(self._layers, mapping)

    def _activate(self, key: LoRAKey, needed: set[LoRAKey]) -> int:
        """A slot holding the adapter; LoRAError, with no slot touched, when it cannot be."""
        adapter = self._host.get(key)
        if adapter is None:
            # The scheduler admits requests whose adapter is in memory, and running ones'
            # stay pinned there; never read a file on the step: fail its requests instead.
            raise LoRAError(f"LoRA adapter {key[0]!r} is not in memory when its step came")
        self._check(adapter)
        slots, pinned = self._slots, self._pinned
        free = [s for s in self._slot_use if slots[s] is None]
        idle = [s for s in self._slot_use if slots[s] not in needed and slots[s] not in pinned]
        slot = (free or idle or [s for s in self._slot_use if slots[s] not in needed])[0]
        slots[slot] = None
        keys = self._keys | set(adapter.weights)
        if adapter.rank > self._rank or keys != self._keys:
            self._resize(max(self._rank, adapter.rank), keys)
        self._copy_into(slot, adapter)
        self._slots[slot] = key
        self.stats.slot_loads += 1
        self._trim_host(needed)  # the adapter it replaced may leave host memory now
        return slot

    def _resize(self, rank: int, keys: set[tuple[int, str]]) -> None:
        """New slot tensors for ``rank`` and the (layer, target) pairs ``keys``; the
        slotted adapters are copied over."""
        self._rank, self._keys = rank, keys
        s, dev, dt = self.max_loras, self.device, self.dtype
        layers: list[list[_GroupSlots | None]] = []
        for layer in range(self.num_layers):
            row: list[_GroupSlots | None] = []
            for g in self.groups:
                names = [t for t, _ in g.targets]
                have = [i for i, t in enumerate(names) if (layer, t) in keys]
                if not have:
                    row.append(None)
                    continue
                lo, hi = have[0], have[-1] + 1
                outs = [out for _, out in g.targets]
                row.append(
                    _GroupSlots(
                        a=torch.zeros((s, g.in_features, (hi - lo) * rank), dtype=dt, device=dev),
                        bs=[torch.zeros((s, rank, o), dtype=dt, device=dev) for o in outs[lo:hi]],
                        targets=tuple(names[lo:hi]),
                        col_lo=sum(outs[:lo]),
                        col_hi=sum(outs[:hi]),
                        full=lo == 0 and hi == len(names),
                    )
                )
            layers.append(row)
        self._layers = layers
        self.stats.resizes += 1
        for slot, key in enumerate(self._slots):
            if key is not None:
                self._copy_into(slot, self._host[key])

    def _copy_into(self, slot: int, adapter: LoRAAdapter) -> None:
        rank, r = self._rank, adapter.rank
        for layer, row in enumerate(self._layers):
            for g in row:
                if g is None:
                    continue
                g.a[slot].zero_()
                for i, target in enumerate(g.targets):
                    b = g.bs[i][slot]
                    b.zero_()
                    w = adapter.weights.get((layer, target))
                    if w is not None:
                        g.a[slot, :, i * rank : i * rank + r].copy_(w[0])
                        b[:r].copy_(w[1])
