"""The front door's ``--metrics-key`` flags, shared by ``kvroute serve`` and ``kvroute
router``: parsed, resolved (flag, file, environment), checked against the tenants' keys, and
handed to ``kvroute serve --routers N``'s other front doors off their command lines."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from kvroute.deploy.cli import build_parser
from kvroute.deploy.router import front_door_metrics_key, front_door_tenants
from kvroute.router.fleet.tenants import METRICS_KEY_ENV


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("command", ["serve", "router"])
def test_both_commands_take_the_metrics_key_flags(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_file = tmp_path / "metrics.key"
    assert parse(command, "--metrics-key", "k").metrics_key == "k"
    assert parse(command, "--metrics-key-file", str(key_file)).metrics_key_file == str(key_file)
    with pytest.raises(SystemExit):  # one or the other
        parse(command, "--metrics-key", "k", "--metrics-key-file", str(key_file))
    capsys.readouterr()
    with pytest.raises(SystemExit):  # kvroute <command> --help
        parse(command, "--help")
    shown = capsys.readouterr().out
    assert "--metrics-key METRICS_KEY" in shown and "--metrics-key-file FILE" in shown


def test_the_metrics_key_comes_from_the_flag_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = tmp_path / "metrics.key"
    key_file.write_text("from-file\nignored\n")
    monkeypatch.setenv(METRICS_KEY_ENV, "from-env")
    assert front_door_metrics_key(parse("router", "--metrics-key", "from-flag")) == "from-flag"
    assert front_door_metrics_key(parse("router", "--metrics-key-file", str(key_file))) == (
        "from-file"
    )
    assert front_door_metrics_key(parse("router")) == "from-env"
    monkeypatch.delenv(METRICS_KEY_ENV)
    assert front_door_metrics_key(parse("router")) is None
    for bad, why in (
        (["--metrics-key-file", str(tmp_path / "missing")], "--metrics-key-file"),
        (["--metrics-key", "two words"], "one non-empty word"),
    ):
        with pytest.raises(ValueError, match=why):
            front_door_tenants(parse("serve", *bad))
    key_file.write_text("")
    with pytest.raises(ValueError, match="one non-empty word"):
        front_door_metrics_key(parse("serve", "--metrics-key-file", str(key_file)))


def test_a_metrics_key_that_is_a_tenants_key_is_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"key-a": "alpha"}))
    args = parse("serve", "--api-keys", str(keys), "--metrics-key", "key-a")
    with pytest.raises(ValueError, match="--metrics-key: it is also a tenant's key"):
        front_door_tenants(args)
    spec = front_door_tenants(parse("serve", "--api-keys", str(keys), "--metrics-key", "m"))
    assert spec is not None and [t.id for t in spec.tenants] == ["alpha"]


class _Started:
    """A stand-in front-door process that says it is ready."""

    def __init__(self) -> None:
        self.stderr = iter([b"kvroute router: ready on ...\n"])


def test_more_front_doors_get_the_metrics_key_off_their_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    from kvroute.deploy import serve

    started: list[tuple[list[str], dict[str, str] | None]] = []

    def popen(cmd: list[str], stderr: Any = None, env: dict[str, str] | None = None) -> Any:
        started.append((cmd, env))
        return _Started()

    class Context:
        gcs_address = "127.0.0.1:6379"

    monkeypatch.setattr(serve.subprocess, "Popen", popen)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: Context())
    serve._start_routers(parse("serve", "--routers", "2", "--metrics-key", "s3cret"), [])
    ((cmd, env),) = started
    assert "s3cret" not in " ".join(cmd) and env is not None and env[METRICS_KEY_ENV] == "s3cret"
    key_file = tmp_path / "metrics.key"
    started.clear()
    serve._start_routers(parse("serve", "--routers", "2", "--metrics-key-file", str(key_file)), [])
    ((cmd, env),) = started
    assert cmd[cmd.index("--metrics-key-file") + 1] == str(key_file) and env is None
