"""``kvroute serve``'s flags: the replicas' engine, Ray placement, KV tiers and step budget,
then the front door's (:mod:`.router`) and the LoRA adapters' (:mod:`.lora_args`).

Kept apart from :mod:`.serve` so the flags a user reads in ``--help`` are one file, and the
startup code another; their checks are :func:`kvroute.deploy.serve.run`'s first lines.
"""

from __future__ import annotations

import argparse

from .lora_args import add_lora_arguments
from .router_args import add_front_door_arguments
from .serve_checks import byte_size


def add_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--model",
        default="smollm2-135m",
        help="smollm2-135m (the default) or tiny, built in; a local Hugging Face folder; or "
        "sim:<profile> for cost-model replicas (sim:h100-8b)",
    )
    serve.add_argument(
        "--engine",
        choices=("kvroute", "vllm"),
        default="kvroute",
        help="the engine inside each replica: kvroute's own, or vLLM's AsyncLLM (needs vLLM "
        "installed: see docs/serving.md); same actors, data plane and router either way",
    )
    serve.add_argument(
        "--dtype", default=None, help="weights' dtype, e.g. float32 (default: fp32 on CPU)"
    )
    serve.add_argument(
        "--max-model-len", type=int, default=None, help="longest prompt + output per request"
    )
    serve.add_argument(
        "--model-impl",
        choices=("auto", "kvroute", "transformers"),
        default="auto",
        help="kvroute's engine: its own decoder for Llama/Mistral/Qwen2/Qwen3/Gemma3 "
        "('kvroute', the default for those) or transformers' modules ('transformers', any other "
        "architecture); see docs/models.md",
    )
    serve.add_argument(
        "--enforce-eager",
        action="store_true",
        help="kvroute's engine on CUDA: run decode steps eager, not from captured CUDA graphs",
    )
    serve.add_argument(
        "--vllm-args",
        default=None,
        metavar="JSON",
        help="--engine vllm: more vLLM engine arguments (AsyncEngineArgs fields), e.g. "
        "'{\"max_num_seqs\": 64}'",
    )
    serve.add_argument(
        "--replicas", type=int, default=None, help="default: 2 locally, one per GPU on a cluster"
    )
    serve.add_argument(
        "--prefill-replicas",
        type=int,
        default=0,
        metavar="N",
        help="P/D: N replicas that compute prompts and hand each request's decode to a "
        "--decode-replicas one, with the prompt's KV (docs/disaggregation.md); --replicas "
        "then adds whole-request replicas beside them (default: none)",
    )
    serve.add_argument(
        "--decode-replicas",
        type=int,
        default=0,
        metavar="M",
        help="P/D: M replicas that decode requests handed off by the prefill replicas",
    )
    serve.add_argument(
        "--kv-link-gbps",
        type=float,
        default=None,
        metavar="GB/S",
        help="the network's KV bandwidth between replicas (P/D, --prefix-fetch), in GB/s: "
        "the router prices a replica's pulls at it until that replica has measured its own "
        "(default: 1, loopback TCP on a small VM; an RDMA fabric carries 25 or more)",
    )
    serve.add_argument("--address", default=None, help="Ray cluster address (e.g. auto)")
    serve.add_argument(
        "--num-cpus-per-replica",
        type=float,
        default=None,
        help="Ray CPUs each replica reserves (default: 1; 0 for sim: replicas, which sleep)",
    )
    serve.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="sim: replicas only: wall seconds per modelled second of each step (e.g. 4: "
        "every step 4x slower, so a small CPU keeps up; divide latencies by it)",
    )
    serve.add_argument(
        "--num-gpus-per-replica", type=float, default=None, help="default: 1 if GPUs, else 0"
    )
    serve.add_argument(
        "--resources-per-replica",
        default=None,
        metavar="JSON",
        help="Ray custom resources each replica needs, e.g. '{\"kvroute_replica\": 1}' to "
        "place one replica per node that offers one",
    )
    serve.add_argument(
        "--runtime-env",
        default=None,
        metavar="JSON",
        help='Ray runtime_env for the replicas, e.g. \'{"env_vars": {"HF_HOME": '
        "\"/models/hf\"}}' or pip/working_dir fields; default: none (the nodes' own image, "
        "which must hold the same kvroute and the model files: see docs/operating.md)",
    )
    serve.add_argument("--num-blocks", type=int, default=None, help="KV blocks per replica")
    serve.add_argument(
        "--kv-host-bytes",
        type=byte_size,
        default=0,
        help="host memory per replica for KV blocks its device cache evicts, e.g. 8GiB "
        "(0: none); a prefix found there is loaded back instead of recomputed "
        "(docs/kv-tiers.md)",
    )
    serve.add_argument(
        "--kv-disk-path",
        default=None,
        help="a local folder for KV blocks evicted past the host tier (or from the device, "
        "without one); each replica uses <path>/<replica id>, wiped when it starts",
    )
    serve.add_argument(
        "--kv-disk-bytes",
        type=byte_size,
        default=0,
        help="disk bytes per replica for KV blocks, e.g. 100GiB",
    )
    serve.add_argument(
        "--kv-disk-encrypt",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="seal the disk tier's blocks (tenants' prompts in KV form) with AES-GCM under a "
        "key held only in the replica's memory, for a disk that is shared, copied or leaves "
        "the host (default: off, the folder private to this user; docs/kv-tiers.md)",
    )
    serve.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="at most this many tokens in one engine step (default 2048, vLLM's for a server): "
        "on a CPU replica a smaller one (512) gives a burst of prompts its first tokens "
        "sooner and stalls running streams for less, for a longer time per output token",
    )
    serve.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="at most this many requests running in one engine (default 128)",
    )
    serve.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="at most this many prompt tokens of one request per engine step (0: no cap): "
        "shorter steps, so a newcomer's first token waits less, for some throughput",
    )
    serve.add_argument(
        "--max-num-partial-prefills",
        type=int,
        default=0,
        help="at most this many requests of one tenant part-way through their prompt at once "
        "(0: no limit); with --long-prefill-token-threshold it bounds every step, which keeps "
        "one tenant's long prompts from delaying another's first token (see docs/serving.md)",
    )
    serve.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per KV block (default: 16; 32 with --engine vllm, as its CPU attention "
        "wants a multiple of 32)",
    )
    serve.add_argument(
        "--routers",
        type=int,
        default=1,
        help="front-door processes sharing --port (SO_REUSEPORT); each admits "
        "--max-in-flight on its own (default: 1)",
    )
    scale = serve.add_argument_group(
        "autoscaling (deploy/autoscale.py)",
        "the fleet's size follows its load, as Ray Serve's autoscaling does: about "
        "--target-ongoing-requests per replica, between --min-replicas and --max-replicas",
    )
    scale.add_argument(
        "--max-replicas",
        type=int,
        default=None,
        help="turns autoscaling on, up to this many replicas (default: off, --replicas fixed)",
    )
    scale.add_argument(
        "--min-replicas",
        type=int,
        default=None,
        help="autoscaling never goes below this (default: --replicas)",
    )
    scale.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=32.0,
        help="requests running or waiting per replica that autoscaling aims for (default: 32)",
    )
    scale.add_argument(
        "--upscale-delay",
        type=float,
        default=30.0,
        help="seconds the load must call for more replicas before they are added (default: 30)",
    )
    scale.add_argument(
        "--downscale-delay",
        type=float,
        default=600.0,
        help="seconds the load must call for fewer replicas before they are drained and "
        "stopped (default: 600)",
    )
    scale.add_argument(
        "--wait-for-resources",
        action="store_true",
        help="grow past what the Ray cluster holds now (and past its autoscaler's known "
        "limit), for nodes that are coming; default: a grow stops at what it holds",
    )
    add_front_door_arguments(serve)
    add_lora_arguments(serve)
