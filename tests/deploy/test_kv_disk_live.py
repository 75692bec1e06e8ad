"""Issue 50's disk-tier findings, live: ``kvroute serve --model tiny`` with a disk tier, as
users run it (its own process, Ray actors, uvicorn), two tenants.

What must hold: the replica's disk folder is 0700 and its block files 0600 while it
serves; every block file replaced by a FIFO (a hung mount's stand-in) hangs nobody -- the
tenant's returning conversation is recomputed with the same text, another tenant's request
is served, /metrics says the disk tier is up; and once the server stops nothing of the
tenants' blocks is left in the folder.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import httpx

from kvroute.router.fleet.tenants import hash_key

from ..prom import scrape, value
from ..ray_session import shutdown
from ..serve_process import kvroute_serve

TENANTS = f"""
admin_keys = ["{hash_key("key-admin")}"]

[[tenants]]
id = "a"
keys = ["{hash_key("key-a")}"]

[[tenants]]
id = "b"
keys = ["{hash_key("key-b")}"]
"""


def complete(url: str, key: str, prompt: list[int]) -> tuple[str, float]:
    """A greedy completion's text and seconds (a bound: a hung replica fails the test)."""
    t0 = time.monotonic()
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0},
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )
    r.raise_for_status()
    return r.json()["choices"][0]["text"], time.monotonic() - t0


def test_fifos_in_a_serving_disk_folder_hang_nobody_and_a_stop_leaves_nothing(
    tmp_path: Path,
) -> None:
    shutdown()  # kvroute serve starts a Ray of its own: none of this process's may linger
    root = tmp_path / "kv"
    (tmp_path / "tenants.toml").write_text(TENANTS)
    args = ["--model", "tiny", "--replicas", "1", "--num-blocks", "16",
            "--kv-disk-path", str(root), "--kv-disk-bytes", "64MiB",
            "--tenants", str(tmp_path / "tenants.toml"),
            "--fleet-secret", "live-kv-disk"]  # fmt: skip
    with kvroute_serve(args) as url:
        conversation = list(b"TENANT-A: my password is hunter2. " + bytes(range(40, 140)))
        first, _ = complete(url, "key-a", conversation)
        for i in range(3):  # more work pushes the conversation out of the 16-block device
            complete(url, "key-b", [(i * 37 + j) % 200 + 30 for j in range(150)])
        deadline = time.monotonic() + 20
        while not (files := list(root.rglob("*.kvb"))) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert files, "nothing reached the disk tier"
        folder = files[0].parent
        assert folder.parent == root / "r0" and stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}
        for f in files:  # every block now blocks a plain open() for reading forever
            f.unlink()
            os.mkfifo(f)
        again, seconds = complete(url, "key-a", conversation)
        assert again == first and seconds < 20
        _, seconds = complete(url, "key-b", list(b"a fresh prompt of another tenant"))
        assert seconds < 20
        samples = scrape(url, key="key-admin")
        assert value(samples, "kvroute:kv_disk_up", replica="r0") == 1.0
        assert value(samples, "kvroute:kv_disk_read_timeouts_total", replica="r0") == 0.0
    assert not list(root.rglob("*"))  # the stopped replica's blocks and folders are gone
