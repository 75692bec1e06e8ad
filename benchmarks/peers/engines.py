"""Phase ``engines`` of ``peers_vllm.py``: one kvroute replica against one ``vllm serve``.

Split out of ``benchmarks/peers_vllm.py`` (whose docstring says what is compared and how):
the datasets, the runs, and what sizes vLLM's KV cache so kvroute gets the same.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from .pieces import Env, bench, client_figures, models_ready, vllm_serve, warm_up
from .procs import Server, Stack, answers, free_port, metric_sum, scrape, shell_line
from .setup import BLOCK_SIZE, MAX_MODEL_LEN, MODEL, say

# --- phase A: engines -------------------------------------------------------------------


def engine_datasets(a: argparse.Namespace) -> dict[str, list[str]]:
    return {
        "prefix_repetition": [
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(a.prefix_len),
            "--prefix-repetition-suffix-len", str(a.suffix_len),
            "--prefix-repetition-num-prefixes", str(a.num_prefixes),
            "--prefix-repetition-output-len", str(a.output_len),
        ],
        "random": [
            "--dataset-name", "random", "--random-input-len", str(a.prefix_len + a.suffix_len),
            "--random-output-len", str(a.output_len), "--random-range-ratio", "0",
        ],
    }  # fmt: skip


def engines_phase(env: Env) -> list[dict]:
    a = env.args
    rows: list[dict] = []
    kv_bytes = a.kv_mib << 20
    num_blocks: int | None = None
    for engine in a.engines:
        with Stack() as stack:
            if engine == "vllm":
                b = vllm_serve(env, "engine-vllm", kv_bytes, events=False, eager=a.vllm_eager)
                server = stack.server(b.server)
                server.wait_ready(models_ready(server.url), a.start_timeout)
                num_blocks = vllm_num_blocks(server.url)
                say(f"vllm serve has {num_blocks} KV blocks of {BLOCK_SIZE} tokens")
                hits = ("vllm:prefix_cache_hits_total",)
                queries = ("vllm:prefix_cache_queries_total",)
            else:
                if num_blocks is None:
                    num_blocks = kv_bytes // smollm2_block_bytes(env.model_dir)
                port = free_port()
                cmd = [
                    env.py, "-m", "kvroute.deploy.cli", "serve", "--model", MODEL,
                    "--replicas", "1", "--num-cpus-per-replica", str(a.threads),
                    "--dtype", "float32", "--block-size", str(BLOCK_SIZE),
                    "--max-model-len", str(MAX_MODEL_LEN), "--num-blocks", str(num_blocks),
                    "--host", "127.0.0.1", "--port", str(port), *a.kvroute_serve_args,
                ]  # fmt: skip
                # A Ray of its own, whatever else runs on the host.
                kenv = {k: v for k, v in env.threads_env().items() if k != "RAY_ADDRESS"}
                url = f"http://127.0.0.1:{port}"
                server = stack.server(
                    Server("engine-kvroute", cmd, kenv, env.out / "engine-kvroute.log", url)
                )
                server.wait_ready(
                    lambda url=url: answers(url + "/health") and answers(url + "/v1/models"),
                    a.start_timeout,
                )
                hits = ("kvroute:prefix_cache_hits_total",)
                queries = ("kvroute:prefix_cache_queries_total",)
            warm_up(server.url)
            for ds, flags in engine_datasets(a).items():
                m0 = scrape(server.url + "/metrics")
                r = bench(env, server.url, f"engines-{engine}-{ds}", flags, a.engine_prompts)
                m1 = scrape(server.url + "/metrics")
                dq = metric_sum(m1, *queries) - metric_sum(m0, *queries)
                dh = metric_sum(m1, *hits) - metric_sum(m0, *hits)
                rows.append({
                    "engine": engine, "dataset": ds, **client_figures(r),
                    "hit_rate": dh / dq if dq > 0 else None, "kv_blocks": num_blocks,
                    "threads": a.threads, "server_command": shell_line(server.cmd),
                })  # fmt: skip
    return rows


def vllm_num_blocks(url: str) -> int | None:
    for name, labels, _ in scrape(url + "/metrics"):
        if name == "vllm:cache_config_info":
            m = re.search(r'num_gpu_blocks="(\d+)"', labels)
            if m:
                return int(m.group(1))
    return None


def smollm2_block_bytes(model_dir: Path) -> int:
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads", c["num_attention_heads"])
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * 4 * BLOCK_SIZE  # K and V, fp32
