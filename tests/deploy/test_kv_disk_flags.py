"""``kvroute serve``'s disk-tier encryption flag reaches the engine config: on unless
``--no-kv-disk-encrypt`` (issue 50)."""

from __future__ import annotations

from kvroute.deploy.cli import build_parser
from kvroute.deploy.serve import engine_config
from kvroute.replica import EngineConfig

DISK = ["serve", "--model", "tiny", "--kv-disk-path", "/tmp/kv", "--kv-disk-bytes", "1GiB"]


def test_disk_blocks_are_sealed_unless_the_flag_says_no() -> None:
    default = engine_config(build_parser().parse_args(DISK))
    assert EngineConfig(**default).kv_disk_encrypt is True
    on = engine_config(build_parser().parse_args([*DISK, "--kv-disk-encrypt"]))
    assert EngineConfig(**on).kv_disk_encrypt is True
    off = engine_config(build_parser().parse_args([*DISK, "--no-kv-disk-encrypt"]))
    assert off["kv_disk_encrypt"] is False and EngineConfig(**off).kv_disk_encrypt is False
