"""``kvroute serve``'s disk-tier encryption flag reaches the engine config: off unless
``--kv-disk-encrypt`` (issue 50: the folder's modes protect by default)."""

from __future__ import annotations

from kvroute.deploy.cli import build_parser
from kvroute.deploy.serve import engine_config
from kvroute.replica import EngineConfig

DISK = ["serve", "--model", "tiny", "--kv-disk-path", "/tmp/kv", "--kv-disk-bytes", "1GiB"]


def test_disk_blocks_are_sealed_when_the_flag_says_so() -> None:
    default = engine_config(build_parser().parse_args(DISK))
    assert EngineConfig(**default).kv_disk_encrypt is False
    on = engine_config(build_parser().parse_args([*DISK, "--kv-disk-encrypt"]))
    assert EngineConfig(**on).kv_disk_encrypt is True
    off = engine_config(build_parser().parse_args([*DISK, "--no-kv-disk-encrypt"]))
    assert EngineConfig(**off).kv_disk_encrypt is False
