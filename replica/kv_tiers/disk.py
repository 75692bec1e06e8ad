"""The KV cache's disk tier: one file per block in a private folder, in LRU order.

The folder holds tenants' data: a KV block is its prompt in another form (layer 0's V of a
token is a function of the token alone). So the store keeps it theirs (issue 50):

- **Its own folder.** Under the configured ``kv_disk_path`` (the *root*) the store makes a
  fresh folder ``kvroute-kv-<random>``, mode 0700 from its ``mkdir`` (never chmod after),
  and works in it through a directory descriptor: nothing is ever written straight into a
  folder it did not just create, whatever the root's modes, and a folder moved or swapped
  under it cannot redirect its files. The root itself, when the store creates it, is made
  0700 too.
- **Files 0600, created so:** ``O_CREAT | O_EXCL | O_NOFOLLOW`` with mode 0600, then an
  atomic rename. Reads open with ``O_NONBLOCK | O_NOFOLLOW`` and ``fstat`` the result: a
  symlink, FIFO or device reads as a miss and never blocks the open.
- **Sealed** with ``--kv-disk-encrypt`` (:mod:`.seal`): AES-256-GCM under a key held in
  memory only, the block hash and length as associated data. Off by default: the modes
  already keep other local users out, and an open costs 15-50% of a lone block's load from
  the page cache (BENCHMARKS, issue 50); on a shared file system (:mod:`.mounts`), where the
  modes do not reach, an unsealed store warns at start. A file that fails authentication --
  another process's, another block's renamed, tampered -- reads as a miss. Without
  encryption a file carries an xxh3-64 of its payload (xor that of its hash, so a renamed
  file fails too) instead, checked the same way.
- **Removed** when the store closes (a clean stop) and, for a store that could not close
  (a killed process), by the next store to open on the same root.

Why wipe at start: a restarted replica's router has dropped its entries (its publisher is
new), and files written by an earlier process carry no trustworthy event history (their
parents, tokens and adapter are what the events need); sealed, they are unreadable anyway
(their key died with the process). So the store removes earlier stores' folders (and loose
``*.kvb`` files of older versions) when it opens, and starts empty.

Invariants:
- ``entries`` (hash -> payload bytes) names exactly the blocks this store counts: each has
  its file, or (under :class:`.kv_disk_writer.DiskWriter`) a write queued or under way that
  will make it; their sizes sum to ``used_bytes <= capacity_bytes``, pending writes counted
  (a file adds a header, and sealed a 16-byte tag, to its payload);
- the LRU order is ``entries``' order: the first is evicted next;
- every file this store makes is under its own folder, 0600, written whole under a
  temporary name then renamed (a reader never sees half a file of its own making);
- the directory descriptor stays open for the store's life (closed when it is collected),
  so a read racing :meth:`close` never opens against a reused descriptor.

Thread-safety: the bookkeeping (:meth:`reserve`, :meth:`forget`, :meth:`touch`, and
:meth:`put`, :meth:`discard`, :meth:`clear` which use it) is one thread's, the engine's.
:meth:`write_file`, :meth:`remove_file`, :meth:`folder_lost` and :meth:`close` touch only
the file system and are the writer thread's; :meth:`read`, :meth:`read_file` and
:meth:`open_body` run on any thread (the disk readers read, the disk fetchers open): a file
removed under a reader reads as a miss. They share no buffer between calls but each
thread's own scratch (:meth:`read`); :meth:`read_file` writes only into the caller's body.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import struct
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from .mounts import file_system, is_shared
from .seal import NONCE_BYTES, TAG_BYTES, Sealer

log = logging.getLogger(__name__)

MAGIC = b"KVB3"  # plain: magic, payload length, xxh3_64 of the payload ^ that of the hash
MAGIC_SEALED = b"KVE2"  # sealed: magic, payload length, nonce; then ciphertext and tag
# Both headers are padded to 64 bytes, so the payload starts on a cache line of the file:
# read into a 64-byte-aligned buffer (:func:`aligned_empty`), the kernel copies it from the
# page cache aligned, about twice as fast here as at the 20 or 24 bytes in of the bare
# fields (an 8-byte skew costs up to 7x).
HEADER_BYTES = 64
_HEADER = struct.Struct(f"<4sQQ{HEADER_BYTES - 20}x")
_SEALED_HEADER = struct.Struct(f"<4sQ{NONCE_BYTES}s{HEADER_BYTES - 12 - NONCE_BYTES}x")
assert _HEADER.size == _SEALED_HEADER.size == HEADER_BYTES  # both layouts pad to it
SUFFIX = ".kvb"
FOLDER_PREFIX = "kvroute-kv-"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC


def aligned_empty(size: int) -> np.ndarray:
    """``size`` bytes, not zeroed, starting on a 64-byte boundary (``np.empty`` gives 16):
    what a file's body is best read into (see ``HEADER_BYTES``)."""
    raw = np.empty(size + 64, dtype=np.uint8)
    skip = -raw.ctypes.data % 64
    return raw[skip : skip + size]


def checksum(data: bytes | memoryview) -> int:
    """xxh3-64 of a block's bytes: fast enough to run on every store and load."""
    return xxhash.xxh3_64_intdigest(data)


def _remove_entries(dir_fd: int) -> int:
    """Unlinks the ``*.kvb*`` entries of an open folder (never follows, never opens one:
    a FIFO among them is removed like a file); returns how many went."""
    n = 0
    with contextlib.suppress(OSError), os.scandir(dir_fd) as it:
        for entry in it:
            if SUFFIX in entry.name:
                with contextlib.suppress(OSError):
                    os.unlink(entry.name, dir_fd=dir_fd)
                    n += 1
    return n


def wipe_root(root: Path) -> int:
    """Removes what earlier stores left under ``root``: their folders (only their
    ``*.kvb*`` files, then the folder if that emptied it) and loose ``*.kvb*`` files of
    older versions, which wrote straight into the root. Returns the files removed."""
    n = 0
    try:
        entries = list(os.scandir(root))
    except OSError:
        return 0
    for entry in entries:
        with contextlib.suppress(OSError):
            if entry.name.startswith(FOLDER_PREFIX) and entry.is_dir(follow_symlinks=False):
                fd = os.open(entry.path, _DIR_FLAGS)
                try:
                    n += _remove_entries(fd)
                finally:
                    os.close(fd)
                os.rmdir(entry.path)
            elif SUFFIX in entry.name and not entry.is_dir(follow_symlinks=False):
                os.unlink(entry.path)
                n += 1
    return n


def wipe_replica_folders(path: str | os.PathLike[str]) -> int:
    """After a fleet stopped (its replicas' processes gone, as Ray ends them: killed, with
    no close): what its replicas' stores left under their folders ``path/<replica id>``,
    and those folders when that empties them. ``kvroute serve`` calls it at its stop."""
    try:
        with os.scandir(path) as it:
            folders = [e.path for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return 0
    n = 0
    for folder in folders:
        n += wipe_root(Path(folder))
        with contextlib.suppress(OSError):
            os.rmdir(folder)  # only if that emptied it
    return n


class DiskStore:
    """Blocks as files in a private folder under ``path``, at most ``capacity_bytes`` of
    payload, LRU; sealed when ``encrypt``."""

    def __init__(
        self, path: str | os.PathLike[str], capacity_bytes: int, *, encrypt: bool = False
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"kv_disk_bytes must be positive, got {capacity_bytes}")
        self.root = Path(path)
        self._made_root = not self.root.exists()
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        self.num_wiped = wipe_root(self.root)
        self.path = self.root / f"{FOLDER_PREFIX}{secrets.token_hex(8)}"
        os.mkdir(self.path, mode=0o700)  # fresh (a random name): nobody else's, never chmod
        self._fd = os.open(self.path, _DIR_FLAGS)
        weakref.finalize(self, os.close, self._fd)
        st = os.fstat(self._fd)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise OSError(f"KV disk folder {self.path} is not this user's alone")
        self._ident = (st.st_dev, st.st_ino)
        self.sealer = Sealer() if encrypt else None
        self.file_system = file_system(self.path)
        if not encrypt and is_shared(self.file_system):
            log.warning(
                "KV disk tier in %s, on a shared file system (%s): tenants' prompts leave this "
                "host unsealed; --kv-disk-encrypt seals them (docs/kv-tiers.md)",
                self.path,
                self.file_system,
            )
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[bytes, int] = OrderedDict()
        self.used_bytes = 0
        self.write_errors = 0
        self.last_errno = 0  # the writer's last failed write (ENOENT: the folder is gone)
        self.closed = False
        self._count_lock = threading.Lock()
        self._scratch = threading.local()  # each thread's ciphertext buffer, reused
        self.num_refused = 0  # reads of a file that is not a regular one (FIFO, device)
        self.num_unauthentic = 0  # reads that failed authentication or checksum

    @property
    def encrypted(self) -> bool:
        return self.sealer is not None

    def file_bytes(self, size: int) -> int:
        """A file's size for a block of ``size`` bytes: its header (and tag) added."""
        if self.sealer is not None:
            return _SEALED_HEADER.size + size + TAG_BYTES
        return _HEADER.size + size

    def name_of(self, block_hash: bytes) -> str:
        return f"{block_hash.hex()}{SUFFIX}"

    def file_of(self, block_hash: bytes) -> Path:
        return self.path / self.name_of(block_hash)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    # -- bookkeeping (engine thread) ------------------------------------------------------
    def put(self, block_hash: bytes, data: bytes | memoryview, digest: int) -> list[bytes] | None:
        """Writes a block now (most recently used); returns the hashes evicted to make room,
        or None when it could not be written (full disk, bad folder: the block is just
        lost). The engine goes through :class:`.kv_disk_writer.DiskWriter` instead, which
        does the same in two halves: :meth:`reserve` on its thread, :meth:`write_file` on a
        writer thread."""
        fresh = block_hash not in self.entries
        evicted = self.reserve(block_hash, len(data))
        if evicted is None:
            return None
        for old in evicted:
            self.remove_file(old)
        if fresh and not self.write_file(block_hash, data, digest):
            self.write_errors += 1
            self.forget(block_hash)
            return evicted if evicted else None
        return evicted

    def reserve(self, block_hash: bytes, size: int) -> list[bytes] | None:
        """Counts a block of ``size`` bytes in (most recently used) before its file exists,
        evicting from the LRU end to make room; returns the evicted hashes, whose files the
        caller removes, or None when it is larger than the whole store. Bookkeeping only."""
        if size > self.capacity_bytes:
            return None
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return []
        evicted: list[bytes] = []
        while self.used_bytes + size > self.capacity_bytes:
            h, _ = next(iter(self.entries.items()))
            self.forget(h)
            evicted.append(h)
        self.entries[block_hash] = size
        self.used_bytes += size
        return evicted

    def forget(self, block_hash: bytes) -> bool:
        """Drops a block from the bookkeeping (not its file); False when it was not here."""
        size = self.entries.pop(block_hash, None)
        if size is None:
            return False
        self.used_bytes -= size
        return True

    def touch(self, block_hash: bytes) -> None:
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)

    def discard(self, block_hash: bytes) -> bool:
        """Forgets a block and removes its file; False when it was not here."""
        if not self.forget(block_hash):
            return False
        self.remove_file(block_hash)
        return True

    def clear(self) -> None:
        for h in list(self.entries):
            self.discard(h)

    # -- files (the writer thread) --------------------------------------------------------
    def write_file(self, block_hash: bytes, data: bytes | memoryview, digest: int) -> bool:
        """Writes the block's file (sealed when the store encrypts: the cost is the writer
        thread's) as a new 0600 file under a temporary name, then renames it; False on any
        OSError (its errno kept in ``last_errno``), leaving no file."""
        name = self.name_of(block_hash)
        tmp = name + ".tmp"
        try:
            fd = os.open(tmp, _NEW_FLAGS, 0o600, dir_fd=self._fd)
        except OSError as exc:  # EEXIST: something else has the temporary name; not ours
            self.last_errno = exc.errno or 0
            return False
        try:
            try:
                if self.sealer is not None:
                    with memoryview(self._buffer(len(data) + TAG_BYTES)) as buf:
                        sealed = buf[: len(data) + TAG_BYTES]
                        nonce = self.sealer.seal_into(block_hash, data, sealed)
                        header = _SEALED_HEADER.pack(MAGIC_SEALED, len(data), nonce)
                        _write_all(fd, [header, sealed])
                        sealed.release()
                else:
                    header = _HEADER.pack(MAGIC, len(data), digest ^ checksum(block_hash))
                    _write_all(fd, [header, data])
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=self._fd, dst_dir_fd=self._fd)
        except OSError as exc:
            self.last_errno = exc.errno or 0
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._fd)
            return False
        return True

    def _buffer(self, size: int) -> np.ndarray:
        """This thread's scratch buffer, at least ``size`` bytes, 64-byte aligned (as a
        file's payload is): sealed bytes pass through it on their way to or from a file,
        never leaving this module."""
        buf: np.ndarray | None = getattr(self._scratch, "buf", None)
        if buf is None or len(buf) < size:
            buf = self._scratch.buf = aligned_empty(size)
        return buf

    def remove_file(self, block_hash: bytes) -> None:
        """Removes the block's file if there is one."""
        with contextlib.suppress(OSError):
            os.unlink(self.name_of(block_hash), dir_fd=self._fd)

    def folder_lost(self) -> str | None:
        """Why the store's folder no longer serves (deleted, or its path now names another
        folder or nothing), or None while it does. Stats only: never opens a file."""
        try:
            if os.fstat(self._fd).st_nlink == 0:
                return "deleted"
            st = os.lstat(self.path)
        except FileNotFoundError:
            return "moved away"
        except OSError as exc:
            return f"unreadable ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
        if (st.st_dev, st.st_ino) != self._ident:
            return "replaced"
        return None

    def close(self) -> None:
        """Removes the store's files and folder (and the root, when the store made it and it
        is left empty): the tenants' blocks do not outlive a clean stop. Files of a folder
        moved away are removed through the descriptor; a path that names another folder
        now is left alone."""
        if self.closed:
            return
        self.closed = True
        _remove_entries(self._fd)
        if self.folder_lost() is None:
            with contextlib.suppress(OSError):
                os.rmdir(self.path)
            if self._made_root:
                with contextlib.suppress(OSError):
                    os.rmdir(self.root)

    # -- any thread -----------------------------------------------------------------------
    def body_bytes(self, size: int) -> int:
        """What follows a file's header for a block of ``size`` bytes (its payload, and
        sealed its 16-byte tag): the size of the ``body`` buffer :meth:`read_file` fills."""
        return size + TAG_BYTES if self.sealer is not None else size

    def read(self, block_hash: bytes, expected_size: int) -> bytearray | None:
        """The block's verified bytes (a buffer of their own), or None if its file is
        missing, not a regular file, of the wrong size, foreign, tampered with or corrupt:
        :meth:`read_file` then :meth:`open_body`, in one call. The engine's fetcher makes
        the two calls itself (:class:`.disk_reads.DiskFetcher`), on two threads."""
        n = self.body_bytes(expected_size)
        if self.sealer is None:  # plain: read straight into what is returned, aligned
            raw = bytearray(n + 63)
            skip = -np.frombuffer(raw, dtype=np.uint8).ctypes.data % 64
            with memoryview(raw) as view:
                body = view[skip : skip + n]
                header = self.read_file(block_hash, expected_size, body)
                ok = header is not None and self.open_body(
                    block_hash, expected_size, header, body, body
                )
                body.release()
            del raw[:skip]  # the payload in place: its start moves, no byte does
            del raw[n:]
            return raw if ok else None
        scratch = self._buffer(n)
        header = self.read_file(block_hash, expected_size, memoryview(scratch[:n]))
        if header is None:
            return None
        out = bytearray(expected_size)
        return out if self.open_body(block_hash, expected_size, header, scratch[:n], out) else None

    def read_file(
        self,
        block_hash: bytes,
        expected_size: int,
        body: memoryview,
        reading: Callable[[], object] | None = None,
    ) -> bytes | None:
        """Reads the block's file: returns its header, its body (``body_bytes`` of them: the
        payload, sealed or not) read straight into ``body`` (the caller's); None if the file
        is missing, not a regular file, of the wrong size or short. Verifies nothing: that is
        :meth:`open_body`'s. ``reading`` is called once the file is open and checked, just
        before the read itself (a reader thread's read releases the GIL there: the fetcher
        waits for it before it opens the previous block, see :mod:`.disk_reads`).

        Opening never blocks (a FIFO is refused on its ``fstat``); reading a regular file
        may, on a disk that hangs, which is why the engine reads through
        :class:`.disk_reads.DiskReads`. An abandoned read may still write into ``body``
        later: its caller never reuses it."""
        if self.closed or len(body) != self.body_bytes(expected_size):
            return None
        header = bytearray((_SEALED_HEADER if self.sealer is not None else _HEADER).size)
        try:
            fd = os.open(self.name_of(block_hash), _READ_FLAGS, dir_fd=self._fd)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self._count("num_refused")
                return None
            if st.st_size != len(header) + len(body):
                return None
            if reading is not None:
                reading()
            if _read_all(fd, [memoryview(header), body]) != len(header) + len(body):
                return None
        except OSError:
            return None
        finally:
            os.close(fd)
        return bytes(header)

    def open_body(
        self,
        block_hash: bytes,
        expected_size: int,
        header: bytes,
        body: memoryview | bytearray,
        out: Any,
    ) -> bool:
        """Verifies a file's header and body as :meth:`read_file` gave them and leaves the
        block's bytes in ``out`` (a writable buffer of ``expected_size``): sealed, opened
        (authenticated, then decrypted) from ``body`` into ``out``; plain, ``body`` must be
        ``out`` itself (read straight into it), its xxh3 checked. False (counted) when they
        fail: another process's key, another block's file, tampered, corrupt; then ``out``
        holds nothing to use and the caller drops it."""
        ok = False
        if self.sealer is not None:
            magic, size, nonce = _SEALED_HEADER.unpack(header)
            if magic == MAGIC_SEALED and size == expected_size:
                ok = self.sealer.open_into(block_hash, nonce, body, out)
        else:
            magic, size, digest = _HEADER.unpack(header)
            ok = magic == MAGIC and size == expected_size and len(body) == size
            ok = ok and checksum(body) ^ checksum(block_hash) == digest
        if not ok:
            self._count("num_unauthentic")
        return ok

    def _count(self, name: str) -> None:
        with self._count_lock:
            setattr(self, name, getattr(self, name) + 1)

    def check_invariants(self) -> None:
        if self.used_bytes != sum(self.entries.values()):
            raise AssertionError("used_bytes does not add up")
        if self.used_bytes > self.capacity_bytes:
            raise AssertionError("over capacity")


def _write_all(fd: int, parts: list[bytes | memoryview]) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _read_all(fd: int, views: list[memoryview]) -> int:
    """Fills ``views`` in order from ``fd`` (from its start; one ``readv`` unless the
    kernel returns less); the bytes read, short at end of file."""
    views = [v.cast("B") for v in views if v.nbytes]
    got = 0
    while views:
        n = os.readv(fd, views)
        if n == 0:
            break
        got += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return got
