"""The disk tier knows when its folder is on a shared file system (network, cluster, FUSE),
where the folder's modes do not keep tenants' blocks in, and warns at start when it does
not seal them there (issue 50)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvroute.replica.kv_tiers import disk as kv_disk
from kvroute.replica.kv_tiers.disk import DiskStore
from kvroute.replica.kv_tiers.mounts import file_system, is_shared

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 27 0:50 / /mnt/kv rw,relatime shared:7 - nfs4 fs:/export rw,vers=4.2
41 40 0:51 / /mnt/kv/local\\040disk rw - xfs /dev/nvme0n1 rw
42 27 0:52 / /mnt/kvx rw - fuse.s3fs s3fs rw
"""


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/mnt/kv/replica-a", "nfs4"),  # not there yet: its nearest ancestor's mount
        ("/mnt/kv", "nfs4"),
        ("/mnt/kv/local disk/x", "xfs"),  # the longest mount point, its name unescaped
        ("/mnt/kvx/a", "fuse.s3fs"),  # /mnt/kv is not a prefix of /mnt/kvx's paths
        ("/var/tmp/kv", "ext4"),
    ],
)
def test_the_folder_s_file_system_is_the_longest_mount_point_above_it(path: str, kind: str) -> None:
    assert file_system(path, MOUNTINFO) == kind


def test_shared_file_systems_are_told_from_local_ones() -> None:
    assert all(is_shared(k) for k in ("nfs4", "cifs", "ceph", "lustre", "fuse.s3fs", "fuse"))
    assert not any(is_shared(k) for k in ("ext4", "xfs", "tmpfs", "overlay", "unknown"))


def test_this_machine_s_tmp_is_read_from_the_real_table(tmp_path: Path) -> None:
    assert file_system(tmp_path) not in ("", "unknown")


@pytest.mark.parametrize("encrypt", [False, True])
def test_an_unsealed_store_on_a_shared_file_system_warns_at_start(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    encrypt: bool,
) -> None:
    monkeypatch.setattr(kv_disk, "file_system", lambda path: "nfs4")
    with caplog.at_level(logging.WARNING, logger=kv_disk.__name__):
        store = DiskStore(tmp_path / "kv", 1 << 20, encrypt=encrypt)
    warned = [r for r in caplog.records if "shared file system (nfs4)" in r.getMessage()]
    assert len(warned) == (0 if encrypt else 1)
    assert store.file_system == "nfs4"
    store.close()


def test_a_store_on_a_local_disk_does_not_warn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kv_disk, "file_system", lambda path: "ext4")
    with caplog.at_level(logging.WARNING, logger=kv_disk.__name__):
        DiskStore(tmp_path / "kv", 1 << 20).close()
    assert not caplog.records
