"""The control side of a ``vllm serve`` backend: what the fleet's monitor asks a replica
(``info``, ``health``, ``load``), answered from vLLM's own HTTP endpoints.

Why the shape:
- :class:`HttpBackend` answers ``backend.info.remote()``, ``.health.remote()`` and
  ``.load.remote()`` with awaitables, as a Ray actor handle does, so :mod:`.fleet`'s
  monitor (restarts, recoveries, load polls) runs unchanged over Ray replicas and HTTP
  backends alike.
- Everything kvroute must agree on is read from the engine, not assumed:
  ``vllm:cache_config_info`` on ``/metrics`` names the block size, whether prefix caching is
  on and its hash algorithm; ``/v1/models`` the served name, weights folder and context.
  Only the hash seed cannot be read (vLLM takes ``$PYTHONHASHSEED`` when set, else
  ``vllm-none-hash``): it is a flag. A backend whose hash kvroute cannot reproduce (vLLM's
  default ``sha256``) is reported as ``vllm:<algo>`` and indexed by its events' token ids
  (:mod:`kvroute.events.translate`); one without prefix caching, or whose block size is
  not ``--block-size``, is refused with what to change.
- The incarnation is the server's ``process_start_time_seconds``: a restarted ``vllm
  serve`` (new cache, event seq from 0) is followed as a restarted replica.
- Load comes from ``/metrics`` (running and waiting requests, KV use), at most every
  ``min_load_interval_s`` (every ``idle_load_interval_s`` while the backend is idle, or
  while its last read counted no request the router had not sent: the router's own
  count is then the whole of it): rendering vLLM's ~50 kB of metrics costs its API server
  CPU, and reading it the router's.
- Its own pool of connections (:mod:`.wire`'s, not the data plane's): health checks must
  not queue behind a data pool full of streams. Not httpx: a GET of ``/metrics`` through it
  cost the router ~1.9 ms of CPU against ~0.4 ms here, several times a second per backend.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvroute.events.load import LoadReport
from kvroute.events.replica_api import ReplicaInfo
from kvroute.events.translate import from_vllm_hash_algo

from .wire import BackendPool

HASH_ALGO = "sha256_cbor_tagged"  # vLLM 0.32's sha256_cbor, salts tagged (events/hashing.py)
VLLM_HASH_ALGO = "sha256_cbor"  # the `--prefix-caching-hash-algo` kvroute reproduces
VLLM_DEFAULT_SEED = "vllm-none-hash"  # vLLM's seed for sha256* without $PYTHONHASHSEED
HASH_FORM = "int"  # vLLM publishes block hashes as uint64 ints
# A /metrics read at least this recent stands for a fresh one in info() (and one within the
# backend's current read interval, as fresh as its load view): info's liveness poll then
# costs no read of its own -- vLLM renders ~56 kB of /metrics per read, whatever is asked.
SAME_ROUND_S = 0.1
_WANTED = (
    "vllm:num_requests_running{",
    "vllm:num_requests_waiting{",
    "vllm:kv_cache_usage_perc{",
    "vllm:cache_config_info{",
    "process_start_time_seconds ",
)


class BackendError(RuntimeError):
    """A backend kvroute cannot front as configured (the message says what to change)."""


# A P/D backend given without its KV events follows this endpoint, which nothing binds: its
# stream stays empty, and the policy routes to it by load alone.
NO_EVENTS_PREFIX = "inproc://kvroute-no-events/"


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """One ``--backend URL=EVENTS_ENDPOINT[,REPLAY_ENDPOINT]``, or one ``--prefill`` /
    ``--decode URL[=EVENTS_ENDPOINT[,REPLAY_ENDPOINT]]`` (``role``: its P/D role,
    :mod:`kvroute.router.routing.disagg`; its events optional)."""

    url: str
    events_endpoint: str
    replay_endpoint: str | None = None
    role: str = "both"

    @classmethod
    def parse(cls, text: str, role: str = "both") -> BackendSpec:
        flag = "--backend" if role == "both" else f"--{role}"
        url, sep, events = text.partition("=")
        if role != "both" and not sep:  # no events: indexed by nothing, routed by load
            sep, events = "=", NO_EVENTS_PREFIX + (urlsplit(url).netloc or url)
        if not sep or not events or not url.startswith(("http://", "https://")):
            raise ValueError(
                f"{flag} {text!r}: expected URL=EVENTS_ENDPOINT[,REPLAY_ENDPOINT], e.g. "
                "http://10.0.0.5:8000=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558"
            )
        pub, _, replay = events.partition(",")
        for ep in (pub, replay):
            if ep and not ep.startswith(("tcp://", "ipc://", NO_EVENTS_PREFIX)):
                raise ValueError(f"{flag} {text!r}: {ep!r} is not a ZeroMQ endpoint")
        return cls(url.rstrip("/"), pub, replay or None, role)

    @property
    def replica_id(self) -> str:
        """``host:port``: what /metrics and ``x-kvroute-replica`` call it."""
        parts = urlsplit(self.url)
        return parts.netloc or self.url


@dataclass(slots=True)
class BackendMetrics:
    """The few figures of vLLM's ``/metrics`` kvroute reads."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    start_time: str | None = None
    cache_config: dict[str, str] = field(default_factory=dict)


def parse_metrics(text: str) -> BackendMetrics:
    """Scans the exposition text for the wanted lines only (a full parse of ~50 kB of
    histograms per poll would cost the router's loop for nothing). Summed over engines
    (``engine="0"``, ``"1"``...: a data-parallel server is one backend)."""
    m = BackendMetrics()
    for line in _wanted_lines("\n" + text):
        head, _, value = line.rpartition(" ")
        if line.startswith("process_start_time_seconds"):
            m.start_time = value
        elif line.startswith("vllm:cache_config_info{"):
            m.cache_config = _labels(head[len("vllm:cache_config_info") :])
        elif line.startswith("vllm:num_requests_running"):
            m.running += float(value)
        elif line.startswith("vllm:num_requests_waiting"):
            m.waiting += float(value)
        else:
            m.kv_usage = max(m.kv_usage, float(value))
    return m


def _wanted_lines(text: str) -> list[str]:
    """The lines of ``text`` (which starts with a newline) that start with one of
    ``_WANTED``, each kind in the text's order: found with ``str.find``, not by splitting
    ~80 kB into lines (a third of the time)."""
    out = []
    for prefix in _WANTED:
        needle = "\n" + prefix
        i = text.find(needle)
        while i >= 0:
            j = text.find("\n", i + 1)
            out.append(text[i + 1 : j if j >= 0 else None].rstrip("\r"))
            i = text.find(needle, j) if j >= 0 else -1
    return out


def _labels(text: str) -> dict[str, str]:
    """``{a="1",b="x"}`` as a dict (vLLM's label values hold no quotes or commas we need)."""
    out: dict[str, str] = {}
    for part in text.strip("{}").split('",'):
        key, _, value = part.partition("=")
        out[key.strip()] = value.strip().strip('"')
    return out


def build_info(
    spec: BackendSpec,
    models: dict[str, Any],
    metrics: BackendMetrics,
    *,
    topic: str,
    hash_seed: str,
    block_size: int | None,
) -> ReplicaInfo:
    """The backend as a :class:`ReplicaInfo`; raises :class:`BackendError` when it caches
    no prefixes, its blocks are not ``block_size`` tokens, or it serves no model."""
    rid = spec.replica_id
    cards = models.get("data") or []
    if len(cards) != 1:
        raise BackendError(f"backend {rid}: serves {len(cards)} models; kvroute fronts one")
    card = cards[0]
    cc = metrics.cache_config
    hash_algo = HASH_ALGO
    if cc:
        if cc.get("enable_prefix_caching") != "True":
            raise BackendError(f"backend {rid}: start vllm serve with --enable-prefix-caching")
        # sha256_cbor: indexed by its hashes; any other: by its events' token ids.
        hash_algo = from_vllm_hash_algo(cc.get("prefix_caching_hash_algo") or VLLM_HASH_ALGO)
        engine_block = int(cc["block_size"])
        if block_size is not None and block_size != engine_block:
            raise BackendError(
                f"backend {rid}: its block size is {engine_block}, not --block-size "
                f"{block_size}; the router must hash the blocks the engine hashes"
            )
        block_size = engine_block
        num_blocks = int(cc.get("num_gpu_blocks") or 0)
    elif block_size is None:
        raise BackendError(
            f"backend {rid}: its /metrics has no vllm:cache_config_info (started with "
            "--disable-log-stats?): give --block-size to say its block size"
        )
    else:
        num_blocks = 0
    host = urlsplit(spec.url).hostname or ""
    model_path = str(card.get("root") or card["id"])
    return ReplicaInfo(
        replica_id=rid,
        model=str(card["id"]),
        model_path=model_path,
        hash_algo=hash_algo,
        hash_seed=hash_seed,
        hash_form=HASH_FORM,
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=int(card.get("max_model_len") or 0),
        data_endpoint=spec.url,
        events_endpoint=spec.events_endpoint,
        replay_endpoint=spec.replay_endpoint,
        topic=topic,
        node_ip=host,
        pid=0,  # not known from outside
        incarnation=f"{rid}@{metrics.start_time or 'unknown'}",
        restarted=False,
        vocab_size=_vocab_size(model_path),
        role=spec.role,
    )


def _vocab_size(folder: str) -> int | None:
    """The model's vocabulary, from its ``config.json`` when its folder is on this host:
    the front door refuses token ids past it with a 400 (vLLM would, as an error event)."""
    try:
        with open(Path(folder) / "config.json", "rb") as f:
            config = json.loads(f.read())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if isinstance(size, int) and size > 0 else None


def load_report(metrics: BackendMetrics, block_size: int) -> LoadReport:
    """vLLM's gauges as a :class:`LoadReport`. vLLM does not split running requests into
    prefills and decodes, nor say how many prompt tokens wait: running counts as
    decoding, its KV in use as their context, and the router's own in-flight accounting
    fills in the queued prefill (:mod:`.load`)."""
    total = int(metrics.cache_config.get("num_gpu_blocks") or 0)
    used = round(metrics.kv_usage * total)
    running = int(metrics.running)
    return LoadReport(
        num_waiting=int(metrics.waiting),
        num_running=running,
        num_decoding=running,
        queued_prefill_tokens=0,
        decode_context_tokens=used * block_size,
        free_blocks=max(0, total - used),
        total_blocks=total,
    )


class _Call:
    """``backend.info.remote()``, as on a Ray actor handle: a fresh awaitable per call."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[], Awaitable[Any]]) -> None:
        self._fn = fn

    def remote(self) -> Awaitable[Any]:
        return self._fn()


class HttpBackend:
    """One ``vllm serve`` as the fleet's monitor sees a replica."""

    def __init__(
        self,
        spec: BackendSpec,
        info: ReplicaInfo,
        *,
        hash_seed: str = VLLM_DEFAULT_SEED,
        block_size: int | None = None,
        min_load_interval_s: float = 0.5,
        idle_load_interval_s: float = 2.0,
        timeout_s: float = 5.0,
    ) -> None:
        """``info``: what the backend said at start-up (:func:`describe`). Load is read at
        most every ``min_load_interval_s``, every ``idle_load_interval_s`` while the backend
        runs and queues nothing (an idle fleet costs its router and its backends less; the
        router's own in-flight accounting covers what it sends meanwhile, :mod:`.load`)."""
        self.spec = spec
        self.hash_seed = hash_seed
        self.block_size = block_size
        self.min_load_interval_s = min_load_interval_s
        self.idle_load_interval_s = idle_load_interval_s
        self.timeout_s = timeout_s
        self._info = info
        self._models: dict[str, Any] | None = None
        self._info_key: tuple[Any, ...] | None = None  # what self._info was built from
        self._report: LoadReport | None = None
        self._report_at = float("-inf")  # when /metrics was last read
        # Whether others send to it too: its last read counted more requests than the
        # router had there (:meth:`observe`). Until a read says not, assume they do.
        self.shared = True
        self._last_metrics: BackendMetrics | None = None
        self._pool: BackendPool | None = None
        self.info = _Call(self._get_info)
        self.health = _Call(self._get_health)
        self.load = _Call(self._get_load)

    @property
    def pool(self) -> BackendPool:
        if self._pool is None:  # made on the loop that uses it
            self._pool = BackendPool(self.spec.url, connect_timeout_s=self.timeout_s, max_idle=4)
        return self._pool

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    async def _get(self, path: str) -> bytes:
        """The body of ``GET path``, whole, within ``timeout_s``; raises
        :class:`BackendError` on a status other than 200, ``TimeoutError`` or the pool's
        ``ConnectionError`` s (:mod:`.wire`) when it does not answer."""
        pool = self.pool
        head = (
            f"GET {pool.base_path}{path} HTTP/1.1\r\nhost: {pool.host_header}\r\n"
            "accept: */*\r\n\r\n"
        ).encode("latin-1")
        async with asyncio.timeout(self.timeout_s):
            _, status, body = await pool.send(head, None)
        if status != 200:
            raise BackendError(f"backend {self.spec.replica_id}: GET {path}: HTTP {status}")
        return body

    async def _metrics(self) -> BackendMetrics:
        return parse_metrics((await self._get("/metrics")).decode(errors="replace"))

    async def _get_info(self) -> ReplicaInfo:
        """Fresh: the monitor's liveness check and restart detection. A /metrics read
        made within the backend's current read interval (at least ``SAME_ROUND_S``) is
        fresh: the backend answered then, and a restart since is seen at the next read, as
        a failure is. So the periodic reads are the load's (:meth:`_get_load`, after which
        the monitor tells the backend its own count: :meth:`observe`), and info rides on
        them: the monitor's round reads a due load before it polls info."""
        metrics = self._last_metrics
        fresh_s = max(SAME_ROUND_S, self._read_interval())
        read = metrics is None or time.monotonic() - self._report_at > fresh_s
        if read:
            metrics = await self._metrics()
        assert metrics is not None
        if self._models is None or not self._info.incarnation.endswith(f"@{metrics.start_time}"):
            self._models = json.loads(await self._get("/v1/models"))
            self._info_key = None
        # The same process with the same cache: the same info (built again, it would read
        # the model's config.json every poll for its vocabulary).
        key = (metrics.start_time, tuple(metrics.cache_config.items()))
        if key != self._info_key:
            self._info = build_info(
                self.spec,
                self._models,
                metrics,
                topic=self._info.topic,
                hash_seed=self.hash_seed,
                block_size=self.block_size,
            )
            self._info_key = key
        # Remembered after the info is built (the report counts in its block size); a
        # re-used read is not made fresh again, or the next read would never come due.
        if read:
            self._remember(metrics)
        return self._info

    async def _get_health(self) -> None:
        await self._get("/health")

    def cached_load(self) -> LoadReport | None:
        """What ``load.remote()`` returns while no read of /metrics is due (the last
        report), without awaiting anything; None when it would read. The fleet's monitor
        asks this first, so a poll that is not due costs it no task."""
        report = self._report
        return report if self.load_due_in(time.monotonic()) > 0 else None

    def load_due_in(self, now: float) -> float:
        """Seconds until :meth:`cached_load` says a read is due (0: due now): how soon the
        fleet's monitor needs its next round for this backend."""
        if self._report is None:
            return 0.0
        return max(0.0, self._report_at + self._read_interval() - now)

    def _read_interval(self) -> float:
        """Seconds between reads of /metrics: ``min_load_interval_s`` while the backend
        runs requests others sent, else ``idle_load_interval_s`` (see :meth:`observe`)."""
        interval = self.min_load_interval_s
        if self._report is not None and (not self.shared or not self._busy()):
            interval = max(interval, self.idle_load_interval_s)
        return interval

    def _busy(self) -> bool:
        """The last report counts a request running or waiting."""
        report = self._report
        return report is not None and bool(report.num_running or report.num_waiting)

    def good_for(self, now: float) -> float:
        """Seconds the last report stands in the load view past its ttl: to the next read,
        but never longer than a busy, shared backend's would (``min_load_interval_s``
        after it was read) while it runs anything: a read put off because the router is
        its only client must not leave a stale count in the view (the router's own count
        is the exact one then)."""
        if self._report is not None and not self._busy():
            return self.load_due_in(now)
        busy_until = self._report_at + self.min_load_interval_s - now
        return max(0.0, min(self.load_due_in(now), busy_until))

    def observe(self, own_in_flight: int) -> None:
        """After a read: ``own_in_flight``, the router's requests at this backend (the
        most it had while the read was out). A backend that runs and queues no more than
        that serves this router alone, and is read every ``idle_load_interval_s`` while
        it does: its report then tells the router little that its own count does not, and
        each read of vLLM's ~56 kB ``/metrics`` costs both sides CPU. One that runs more
        (another router, a client of its own) is read every ``min_load_interval_s``."""
        report = self._report
        if report is not None:
            self.shared = report.num_running + report.num_waiting > own_in_flight

    async def _get_load(self) -> LoadReport:
        report = self.cached_load()
        if report is None:
            self._remember(await self._metrics())
            report = self._report
        assert report is not None
        return report

    def _remember(self, metrics: BackendMetrics) -> None:
        self._report = load_report(metrics, self._info.block_size)
        self._last_metrics = metrics
        self._report_at = time.monotonic()


def describe(
    spec: BackendSpec,
    *,
    topic: str,
    hash_seed: str = VLLM_DEFAULT_SEED,
    block_size: int | None = None,
    wait_s: float = 0.0,
    say: Callable[[str], None] | None = None,
) -> tuple[HttpBackend, ReplicaInfo]:
    """The backend and its info, once it answers (waiting up to ``wait_s`` for a ``vllm
    serve`` still loading its model). Synchronous: run before the front door's loop exists."""
    deadline = time.monotonic() + wait_s
    told = False
    with httpx.Client(timeout=10.0) as client:
        while True:
            try:
                r = client.get(f"{spec.url}/v1/models")
                r.raise_for_status()
                models = r.json()
                m = client.get(f"{spec.url}/metrics")
                m.raise_for_status()
                break
            except httpx.HTTPError as exc:
                if time.monotonic() >= deadline:
                    why = f"backend {spec.replica_id} does not answer ({exc})"
                    raise BackendError(why) from None
                if say is not None and not told:
                    say(f"waiting for backend {spec.url} ({type(exc).__name__})")
                    told = True
                time.sleep(1.0)
    metrics = parse_metrics(m.text)
    info = build_info(
        spec, models, metrics, topic=topic, hash_seed=hash_seed, block_size=block_size
    )
    backend = HttpBackend(spec, info, hash_seed=hash_seed, block_size=block_size)
    backend._models = models
    return backend, info
