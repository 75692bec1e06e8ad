"""``kvroute router``'s flags, and the front door's that ``kvroute serve`` shares.

Kept apart from :mod:`.router` so the flags a user reads in ``--help`` are one file and the
start-up code another, as :mod:`.serve_args` does for ``kvroute serve``.
"""

from __future__ import annotations

import argparse

from kvroute.router.fleet.flow import DEFAULT_DEPTH, DEFAULT_TOKENS

from .router import RAY_NAMESPACE

# A burst waits rather than fails, as it would on one vLLM server (which queues without
# bound): deep enough for a benchmark client that sends everything at once, bounded so an
# overloaded fleet still answers 429 within a minute, under every common client's timeout.
ADMISSION_TIMEOUT_S = 60.0


def add_front_door_arguments(p: argparse.ArgumentParser) -> None:
    """What every front door takes, whether ``serve`` or ``router`` starts it."""
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: loopback only; 0.0.0.0 for every interface "
        "needs API keys or --allow-anonymous)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=8000,
        help="port of the OpenAI API (default 8000; 0: a free one, named in the ready line)",
    )
    auth = p.add_mutually_exclusive_group()
    auth.add_argument(
        "--tenants",
        default=None,
        metavar="FILE",
        help="tenants file (TOML): ids, hashed API keys, limits, admin keys; see "
        "deploy/tenants.example.toml",
    )
    auth.add_argument(
        "--api-keys",
        default=None,
        help="development: a flat key file, JSON {key: tenant} or lines key:tenant",
    )
    p.add_argument(
        "--allow-anonymous",
        action="store_true",
        help="serve without API keys on a non-loopback --host (refused otherwise)",
    )
    p.add_argument("--fleet-secret", default=None, help="default: $KVROUTE_FLEET_SECRET")
    metrics_key = p.add_mutually_exclusive_group()
    metrics_key.add_argument(
        "--metrics-key",
        default=None,
        help="a key that reads /metrics and nothing else, for Prometheus (Authorization: "
        "Bearer KEY); admin keys read it too. With keys configured, no other key may "
        "(default: $KVROUTE_METRICS_KEY; prefer it or --metrics-key-file: a value here "
        "shows in the process list)",
    )
    metrics_key.add_argument(
        "--metrics-key-file",
        default=None,
        metavar="FILE",
        help="--metrics-key read from FILE's first line (the file Prometheus' "
        "credentials_file can read too)",
    )
    p.add_argument(
        "--policy",
        default="kv",
        help="how requests are routed: kv (cached prefix and load, the default), "
        "approx_text, least_loaded, round_robin or random (or a simulator baseline: "
        "kv_tier_blind, lora_affinity, kv:lora_blind)",
    )
    p.add_argument(
        "--pd-split",
        choices=("priced", "always", "pair"),
        default="priced",
        help="with prefill and decode replicas: split a request only where the price says "
        "it pays (priced, the default), or every request that can be (always, as vLLM's P/D "
        "proxies do); pair: on a fleet of whole-request replicas, a request may split "
        "between any two where the price says so (kvroute's engine: every replica runs a KV "
        "transfer plane)",
    )
    p.add_argument(
        "--prefix-fetch",
        action="store_true",
        help="a request may go to a replica that pulls its prefix from another replica's "
        "cache instead of queueing behind that replica or recomputing the prefix, where "
        "the price says so (docs/disaggregation.md; kvroute's engine: its replicas run a "
        "KV transfer plane)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (default: --model as given)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="serve tool_choice auto (the default with tools): the model's calls are read "
        "from its text by --tool-call-parser (vLLM's flag); tool_choice required and a named "
        "function are served without it",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=("hermes", "llama3_json", "mistral"),
        help="how the model writes tool calls (vLLM's names): hermes (Qwen2/2.5/3, Hermes; "
        "the built-in models), llama3_json (Llama 3.x), mistral ([TOOL_CALLS]); "
        "see docs/serving.md",
    )
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="requests this front door admits at once; more get 429 (default: 128 per replica)",
    )
    p.add_argument(
        "--max-in-flight-per-tenant",
        type=int,
        default=None,
        help="requests one tenant may hold at once; more get 429 (default: half of "
        "--max-in-flight when two tenants or more are configured, else no own cap); a "
        "tenant's max_concurrent in the tenants file replaces it",
    )
    p.add_argument(
        "--admission-queue",
        type=int,
        default=None,
        help="requests that may wait for a slot past --max-in-flight, first come first "
        "served; more get 429 (default: 8 times --max-in-flight)",
    )
    p.add_argument(
        "--admission-timeout",
        type=float,
        default=ADMISSION_TIMEOUT_S,
        help="seconds a request waits in the admission queue before a 429 (default: "
        f"{ADMISSION_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--flow-depth",
        type=int,
        default=DEFAULT_DEPTH,
        help="flow control: requests without a first token this front door keeps on each "
        "replica; later ones wait at the door, most urgent priority first, least-served "
        f"tenant first within one (0: off, every request sent at once; default {DEFAULT_DEPTH})",
    )
    p.add_argument(
        "--flow-tokens",
        type=int,
        default=DEFAULT_TOKENS,
        help="flow control: and their prompt tokens at most this many (an idle replica "
        "takes any prompt; default: no bound, which keeps routing quality: docs/serving.md)",
    )
    p.add_argument(
        "--max-waiting-per-priority",
        type=int,
        default=None,
        help="flow control: requests one priority may have waiting at the door; more get "
        "429 with Retry-After (default: no bound past admission's)",
    )
    p.add_argument(
        "--priority-header",
        default=None,
        metavar="NAME",
        help="a request header whose integer is the request's priority (vLLM's meaning: "
        "lower runs first), over the body's `priority`, within the tenant's min_priority",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 << 20,
        help="larger request bodies get 413 before they are read (default: 4 MiB)",
    )
    p.add_argument(
        "--log-requests",
        action="store_true",
        help="one log line per finished request on stderr: tenant, replica, prompt/cached/"
        "output tokens, TTFT, status",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds for a request's head, then its body, to arrive whole: a slower head "
        "closes its connection, a slower body gets 408 (default: 30)",
    )
    p.add_argument(
        "--send-timeout",
        type=float,
        default=60.0,
        help="seconds a client may take no piece of its response before it is dropped and "
        "its request ends (a stuck reader holds no slot forever; default: 60)",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_front_door_arguments(p)
    p.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    p.add_argument("--namespace", default=RAY_NAMESPACE, help="where the replicas are named")
    p.add_argument(
        "--reuse-port",
        action="store_true",
        help="bind with SO_REUSEPORT, beside other front doors on the same port",
    )
    b = p.add_argument_group(
        "fronting vllm serve (no Ray)",
        "route to vllm serve processes kvroute did not start, by their KV events",
    )
    b.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="URL=EVENTS[,REPLAY]",
        help="a vllm serve: its base URL, its KV-event PUB endpoint and (optional, for gap "
        "recovery) its replay endpoint, e.g. http://10.0.0.5:8000=tcp://10.0.0.5:5557,"
        "tcp://10.0.0.5:5558; repeat per backend",
    )
    b.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL[=EVENTS[,REPLAY]]",
        help="a vllm serve started with a KV connector (NixlConnector) that runs prompts: "
        "each request's prefill half goes to one of these with vLLM's kv_transfer_params, "
        "its decode to a --decode backend (as vLLM's and llm-d's P/D proxies pair them); "
        "its KV events, when given, let the prefix index choose it; repeat per backend",
    )
    b.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL[=EVENTS[,REPLAY]]",
        help="a vllm serve with the same KV connector that decodes what a --prefill "
        "backend computed (and runs a request whole when its prefill fails); repeat",
    )
    b.add_argument(
        "--events-topic",
        default="",
        help="the topic in the backends' --kv-events-config (default: vLLM's, empty)",
    )
    b.add_argument(
        "--hash-seed",
        default=None,
        help="the backends' $PYTHONHASHSEED if they run with one (default: vLLM's "
        "'vllm-none-hash'); kvroute cannot read it from them",
    )
    b.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="check that the backends use this block size (read from their /metrics; "
        "needed only when they run with --disable-log-stats)",
    )
    b.add_argument(
        "--tokenizer",
        default=None,
        metavar="FOLDER",
        help="the model's tokenizer, when the backends' weights folder is not on this host",
    )
    b.add_argument(
        "--backend-wait",
        type=float,
        default=300.0,
        help="seconds to wait at start-up for backends still loading (default: 300)",
    )


def add_stop_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    p.add_argument("--namespace", default=RAY_NAMESPACE, help="where the replicas are named")
