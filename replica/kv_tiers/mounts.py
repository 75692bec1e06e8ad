"""Which file system holds the disk tier's folder: local, or shared with other hosts.

Why: the tier's blocks are tenants' prompts in KV form. On a local disk the folder's modes
(0700, files 0600: :mod:`.disk`) keep other users out, and the disk stays in the host. On a
network or cluster file system (NFS, SMB, Ceph, Lustre, a FUSE mount of object storage)
the bytes cross a network and rest on a server whose other clients and administrators the
modes do not bind (NFS maps users by number; root squash is a server's choice). There the
blocks should be sealed (``--kv-disk-encrypt``), and the store says so at start when they
are not.

The answer comes from ``/proc/self/mountinfo``: the mount whose mount point is the longest
prefix of the folder's real path (the nearest existing ancestor, for a folder still to be
made). Off Linux, or when it cannot be read, the file system is "unknown" and counts as
local: the warning is advice, never a refusal.
"""

from __future__ import annotations

import os
from pathlib import Path

# Types (mountinfo's field after "-") whose bytes leave this host or are shared with others.
SHARED_FILE_SYSTEMS = frozenset(
    {
        "9p",
        "afs",
        "beegfs",
        "ceph",
        "cifs",
        "davfs",
        "gfs2",
        "glusterfs",
        "gpfs",
        "lustre",
        "nfs",
        "nfs4",
        "ocfs2",
        "smb3",
        "smbfs",
        "virtiofs",
        "wekafs",
    }
)


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def file_system(path: str | os.PathLike[str], mountinfo: str | None = None) -> str:
    """The type of the file system ``path`` is (or would be made) on, as mountinfo names it
    (``ext4``, ``nfs4``, ``fuse.s3fs``...); "unknown" when it cannot tell. ``mountinfo``:
    the table's text (default: this process's)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return "unknown"
    at, rest = Path(path).absolute(), Path()
    while not at.exists() and at != at.parent:  # a folder still to be made: its ancestor's
        at, rest = at.parent, at.name / rest
    real = os.path.normpath(Path(os.path.realpath(at)) / rest)
    best, kind = -1, "unknown"
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        dash = fields.index("-", 6)
        point = _unescape(fields[4])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best and dash + 1 < len(fields):
            best, kind = len(point), fields[dash + 1]
    return kind


def is_shared(kind: str) -> bool:
    """A network, cluster or FUSE file system (FUSE: its bytes go where its daemon sends
    them, an object store as often as a disk)."""
    return kind in SHARED_FILE_SYSTEMS or kind == "fuse" or kind.startswith("fuse.")
