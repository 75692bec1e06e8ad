"""The `kvroute` command, run as a user runs it."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from kvroute.events import BlockHasher, BlockStored, regime_salt
from kvroute.events.transport import ZmqEventPublisher

KVROUTE = [sys.executable, "-m", "kvroute.deploy.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_refuses_bad_arguments_before_starting_anything():
    for args, why in (
        (["--api-keys", "/nonexistent/keys"], "--api-keys"),
        (["--policy", "nope"], "unknown policy"),
        (["--replicas", "0"], "--replicas"),
        (["--tenants", "/nonexistent/tenants.toml"], "--tenants"),
        (["--tenants", "a.toml", "--api-keys", "b"], "not allowed with"),
        (["--host", "0.0.0.0"], "refusing to serve anonymously on 0.0.0.0"),
        (["--runtime-env", "[1]"], "--runtime-env: not a JSON object"),
        (["--model", "gpt2"], "neither a built-in model"),  # no hub downloads: a folder
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--port", "70000"], "--port must be 0-65535"),
        (["--model", "tiny", "--wait-for-resources"], "--wait-for-resources applies to"),
        (["--model", "tiny", "--dtype", "fp16"], "--dtype fp16: not one of"),
        (["--model", "sim:h100-8b", "--kv-host-bytes", "1GiB"], "sim: replicas are cost models"),
        (["--model", "tiny", "--kv-link-gbps", "0"], "--kv-link-gbps must be > 0"),
        (["--model", "sim:h100-8b", "--prefix-fetch"], "--prefix-fetch needs a model"),
        (["--model", "sim:h100-8b", "--pd-split", "pair"], "--pd-split pair: kvroute's engine"),
    ):
        out = subprocess.run([*KVROUTE, "serve", *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and why in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr and "Ray" not in out.stderr, out.stderr
    with socket.socket() as busy:  # another server on the port: one line, no fleet started
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        out = subprocess.run(
            [*KVROUTE, "serve", "--model", "tiny", "--port", port],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert out.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr
    assert "starting" not in out.stderr, out.stderr


def test_router_refuses_a_busy_port_before_it_reaches_ray_or_backends():
    """The socket is bound first: an address where no Ray listens, or a backend that does
    not answer, would hang a router that reached them before finding its port taken."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        for where in (["--address", "127.0.0.1:1"], ["--backend", "http://127.0.0.1:1"]):
            out = subprocess.run(
                [*KVROUTE, "router", *where, "--port", port],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            assert out.returncode == 2, (where, out.stderr)
            assert out.stderr.strip() == (
                f"kvroute router: cannot listen on 127.0.0.1:{port} (Address already in use); "
                "is another server on it? --port"
            ), out.stderr


def refused_fast(args: list[str]) -> tuple[int, str, float]:
    """``kvroute serve ARGS``: (exit status, stderr, seconds). One still running after 60 s
    started a fleet: it is stopped with Ctrl-C (so its Ray ends with it) and fails."""
    t0 = time.monotonic()
    cmd = [*KVROUTE, "serve", "--model", "tiny", "--port", str(free_port()), *args]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        raise AssertionError(f"kvroute serve {args} was not refused:\n{err}") from None
    return proc.returncode, err, time.monotonic() - t0


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--kv-host-bytes", "-1"], "--kv-host-bytes must be >= 0, not -1"),
        (["--kv-disk-path", "{file}", "--kv-disk-bytes", "1GiB"], "is not a folder"),
        (["--kv-host-bytes", "1000000000000000"], "GiB of memory"),
    ],
    ids=["negative", "disk-path-a-file", "host-tier-past-memory"],
)
def test_serve_refuses_impossible_tiers_before_ray_starts(tmp_path, args, why):
    """A negative tier size, a disk "folder" that is a file, a host tier larger than the
    machine: one line, exit status 2, in about the time Python takes to start (not a Ray
    traceback tens of seconds later, nor a fleet started anyway)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    code, err, took = refused_fast([a.format(file=a_file) for a in args])
    print(f"{args}: exit {code} after {took:.1f} s: {err.strip()}")
    assert code == 2 and err.startswith("kvroute serve: --kv-") and why in err, (args, err)
    assert len(err.strip().splitlines()) == 1, err  # one line: no Ray, no traceback
    assert took < 15, took  # a local Ray and a replica take 20 s or more here


def test_router_refuses_bad_front_door_numbers_before_joining_ray():
    # An address where no Ray listens: a router that got past its checks would hang there.
    cmd = [*KVROUTE, "router", "--address", "127.0.0.1:1", "--max-in-flight", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == "kvroute router: --max-in-flight must be >= 1", out.stderr


def test_byte_sizes_read_as_operators_write_them():
    from kvroute.deploy.serve_checks import byte_size

    sizes = ("1000", "64GiB", "1.5G", "512Mi", "2tb")
    assert [byte_size(s) for s in sizes] == [1000, 64 << 30, 1_500_000_000, 512 << 20, 2 * 10**12]
    out = subprocess.run(
        [*KVROUTE, "serve", "--kv-host-bytes", "10**15"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "'10**15' is not a size in bytes" in out.stderr


def new_key() -> tuple[str, str]:
    """``kvroute key``: a new key and the hash a tenants file stores."""
    out = subprocess.run([*KVROUTE, "key"], capture_output=True, text=True, check=True)
    fields = dict(line.split(":", 1) for line in out.stdout.splitlines())
    key, digest = fields["key"].strip(), fields["hash"].strip()
    again = subprocess.run(
        [*KVROUTE, "key", "--hash"], input=key + "\n", capture_output=True, text=True, check=True
    )
    assert again.stdout.strip() == digest and key not in digest
    return key, digest


def test_serve_end_to_end_then_ctrl_c(tmp_path):
    """The real command: local Ray, one tiny replica, a tenants file made with `kvroute key`,
    a request over HTTP, the admin view, Ctrl-C."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (key, digest), (admin, admin_digest) = new_key(), new_key()
    (tmp_path / "tenants.toml").write_text(
        f'admin_keys = ["{admin_digest}"]\n[[tenants]]\nid = "acme"\nkeys = ["{digest}"]\n'
    )
    args = ["serve", "--model", "tiny", "--replicas", "1", "--port", str(port)]
    args += ["--num-blocks", "64", "--tenants", str(tmp_path / "tenants.toml"), "--log-requests"]
    proc = subprocess.Popen([*KVROUTE, *args], stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "ready: model 'tiny'" in line:
                break
        assert any(f"http://127.0.0.1:{port}/v1" in x for x in lines), "".join(lines)
        # Clean logs: Ray's token-auth warning is replaced by one line of ours.
        assert any("Ray token authentication: token" in x for x in lines), "".join(lines)
        assert not any("Token authentication is enabled" in x for x in lines), "".join(lines)
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "ignore_eos": True}
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        assert r.status_code == 200 and r.headers["x-kvroute-replica"] == "r0"
        assert r.json()["usage"]["completion_tokens"] == 3
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body).status_code == 401
        fleet = httpx.get(
            f"http://127.0.0.1:{port}/fleet", headers={"Authorization": f"Bearer {admin}"}
        )
        assert [x["replica_id"] for x in fleet.json()["replicas"]] == ["r0"]
        assert any("1 tenant(s), 0 with limits, 1 admin key(s)" in x for x in lines)
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(timeout=60) == 0 and "stopped" in rest
        # --log-requests: one line for the routed request (the 401 never reached a replica)
        logged = [x for x in rest.splitlines() if " request " in x and "tenant=" in x]
        assert len(logged) == 1, rest
        assert "tenant=acme replica=r0 prompt=" in logged[0]
        assert "output=3 " in logged[0] and logged[0].endswith("status=200 length")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_hash_prints_the_same_hashes_as_the_library():
    tokens = list(range(40))
    out = subprocess.run(
        [*KVROUTE, "hash", ",".join(map(str, tokens)), "--seed", "s", "--cache-salt", "t"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    expected = BlockHasher(seed="s").hash_blocks(tokens, cache_salt="t")
    assert out.stdout.split() == [x for i, h in enumerate(expected) for x in (str(i), h.hex())]
    # a longrope fleet's switch: past it, the regime's salt, as replicas and routers hash
    args = [*KVROUTE, "hash", ",".join(map(str, tokens)), "--seed", "s", "--cache-salt", "t"]
    for after, salt in ((39, regime_salt("t", 40, 39)), (40, "t")):
        out = subprocess.run(
            [*args, "--long-prompt-after", str(after)],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        want = BlockHasher(seed="s").hash_blocks(tokens, cache_salt=salt)
        assert out.stdout.split() == [x for i, h in enumerate(want) for x in (str(i), h.hex())]
    assert regime_salt("t", 40, 39) != "t"


def test_events_follows_a_live_publisher():
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", heartbeat_interval=None)
    try:
        for i in range(3):
            pub.publish([BlockStored([bytes([i + 1]) * 16], None, [0] * 4, 4, None, "GPU", None)])
        proc = subprocess.Popen(
            [*KVROUTE, "events", pub.endpoint, "--replay", pub.replay_endpoint, "--count", "3"],
            stdout=subprocess.PIPE,
            text=True,
        )
        # The subprocess's SUB socket must be subscribed before the live batches, or ZeroMQ
        # drops them; nothing outside that process can tell when it is, so it is given time.
        time.sleep(0.5)
        for i in range(3, 5):
            pub.publish([BlockStored([bytes([i + 1]) * 16], None, [0] * 4, 4, None, "GPU", None)])
        out, _ = proc.communicate(timeout=60)
        lines = out.splitlines()
        assert proc.returncode == 0 and len(lines) == 3
        assert "source=snapshot stored=3" in lines[0]  # what it joined too late for, at once
        assert "source=live stored=1" in lines[1] and "source=live stored=1" in lines[2]
    finally:
        pub.close()


def test_serve_passes_the_step_limits_to_either_engine():
    """--max-num-batched-tokens and --max-num-seqs reach kvroute's engine config, and a
    vLLM replica's engine arguments under vLLM's own names (--vllm-args wins)."""
    from kvroute.deploy.cli import build_parser
    from kvroute.deploy.serve import engine_config
    from kvroute.replica.engine.config import EngineConfig

    limits = ["--max-num-batched-tokens", "512", "--max-num-seqs", "8"]
    own = engine_config(build_parser().parse_args(["serve", "--model", "tiny", *limits]))
    assert (own["max_num_batched_tokens"], own["max_num_seqs"]) == (512, 8)
    cfg = EngineConfig(**own)
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (512, 8)
    assert "max_num_seqs" not in engine_config(build_parser().parse_args(["serve"]))
    args = build_parser().parse_args(["serve", "--engine", "vllm", *limits])
    args.vllm_args = {"max_num_seqs": 4}  # as `serve` reads --vllm-args' JSON
    vllm = engine_config(args)
    assert vllm["engine_args"]["max_num_batched_tokens"] == 512
    assert vllm["engine_args"]["max_num_seqs"] == 4


def test_the_console_script_exits_quietly_where_triton_was_imported():
    """Triton's bindings print hundreds of "leaked" lines at the interpreter's teardown
    (seen after ``kvroute serve: stopped``); the console script (``entry``) skips the
    teardown where Triton was imported, after the exit handlers, with main's exit status
    and its output flushed. The teardown is seen here by an object that speaks when it is
    finalized with the modules."""
    pytest.importorskip("triton")
    script = (
        "import atexit, sys, triton\n"
        "class Teardown:\n"
        "    def __del__(self):\n"
        "        print('torn down', file=sys.stderr)\n"
        "held = Teardown()\n"
        "atexit.register(lambda: print('exit handler ran', file=sys.stderr))\n"
        "sys.argv = ['kvroute', 'hash', '--block-size', '2', '1,2,3,4']\n"
        "from kvroute.deploy.cli import ENTRY\n"
        "ENTRY()\n"
    )

    def run(entry: str, tokens: str = "1,2,3,4") -> subprocess.CompletedProcess[str]:
        code = script.replace("ENTRY", entry).replace("1,2,3,4", tokens)
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )

    out = run("entry")
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.strip().splitlines()) == 2  # two blocks' hashes, flushed
    assert "exit handler ran" in out.stderr
    assert "torn down" not in out.stderr
    assert run("entry", "1,x").returncode == 2  # main's status
    plain = run("main")  # main alone returns; the interpreter then tears down
    assert "torn down" in plain.stderr
