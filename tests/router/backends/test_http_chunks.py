"""``vllm serve``'s streamed completion chunks as kvroute's deltas, its ``/metrics`` as a
replica's info and load, and a request (resumed or not) as its ``/v1/completions`` body.

No vLLM needed: the chunks are the exact lines vLLM 0.32 streamed for a request with
``return_token_ids``, ``stream_options.include_usage`` and ``logprobs`` (captured from a
live ``vllm serve`` of the built-in ``tiny`` model). tests/router/backends/test_http_backend.py runs
the same path against real ``vllm serve`` processes.
"""

from __future__ import annotations

import pytest

from kvroute.events.replica_api import GenerateRequest, Resume, SamplingParams
from kvroute.router.backends.connection import (
    ChunkReader,
    MalformedChunkError,
    ResumeText,
    completion_body,
)
from kvroute.router.backends.control import (
    BackendError,
    BackendSpec,
    build_info,
    load_report,
    parse_metrics,
)

PROMPT = list(range(1, 36))
STREAM = [
    'data: {"id":"cmpl-r1","object":"text_completion","created":1,"model":"tiny","choices":'
    '[{"index":0,"text":"M","logprobs":{"text_offset":[0],"token_logprobs":[-1.77],"tokens":'
    '["token_id:77"],"top_logprobs":[{"token_id:77":-1.77,"token_id:81":-2.0}]},'
    '"finish_reason":null,"stop_reason":null,"prompt_token_ids":[1,2,3],"token_ids":[77]}]}',
    "",
    'data: {"id":"cmpl-r1","object":"text_completion","created":1,"model":"tiny","choices":'
    '[{"index":0,"text":"","logprobs":{"text_offset":[1],"token_logprobs":[-0.7],"tokens":'
    '["token_id:241"],"top_logprobs":[{"token_id:241":-0.7,"token_id:12":-1.8}]},'
    '"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":[241]}]}',
    "",
    'data: {"id":"cmpl-r1","object":"text_completion","created":1,"model":"tiny","choices":'
    '[{"index":0,"text":"\\ufffdV","logprobs":{"text_offset":[2],"token_logprobs":[-0.6],'
    '"tokens":["token_id:86"],"top_logprobs":[{"token_id:86":-0.6,"token_id:34":-1.8}]},'
    '"finish_reason":"length","stop_reason":null,"prompt_token_ids":null,"token_ids":[86]}]}',
    "",
    'data: {"id":"cmpl-r1","object":"text_completion","created":1,"model":"tiny","choices":[],'
    '"usage":{"prompt_tokens":35,"total_tokens":38,"completion_tokens":3,'
    '"prompt_tokens_details":{"cached_tokens":32}},"system_fingerprint":"vllm-0.32.0"}',
    "",
    "data: [DONE]",
]


def feed_all(reader: ChunkReader, lines: list[str]) -> list:
    return [d for line in lines if (d := reader.feed(line)) is not None]


def test_chunks_become_deltas_and_the_finish_waits_for_usage() -> None:
    reader = ChunkReader("r1", num_prompt=len(PROMPT))
    deltas = feed_all(reader, STREAM[:6])
    # The finishing chunk is held: its counts and cached tokens come in the usage chunk.
    assert [d.delta_token_ids for d in deltas] == [[77], [241]]
    assert [d.delta_text for d in deltas] == ["M", ""]
    assert deltas[0].logprobs == [{77: -1.77, 81: -2.0}]
    assert not any(d.finished for d in deltas)
    assert feed_all(reader, STREAM[6:8]) == []  # usage: still held until [DONE]
    (last,) = feed_all(reader, STREAM[8:])
    assert reader.finished
    assert (last.delta_token_ids, last.delta_text) == ([86], "\ufffdV")
    assert (last.finished, last.finish_reason, last.failure) == (True, "length", None)
    assert (last.num_prompt_tokens, last.num_output_tokens) == (35, 3)
    assert last.num_cached_tokens == 32


def test_a_resumed_stream_counts_the_resumed_tokens_and_sends_the_held_text_first() -> None:
    reader = ChunkReader("r1-1", num_prompt=len(PROMPT), done=5, pending_text="held")
    first, *_ = feed_all(reader, STREAM)
    assert first.delta_text == "heldM"
    assert first.num_output_tokens == 6


def test_a_resumed_streams_text_is_made_from_token_ids() -> None:
    """vLLM's deltas after a prompt cut inside a character repeat the prompt's text: the
    reader makes a resumed request's text from its token ids instead."""
    made = list("héllo wö".encode())[:-1]  # the resumed tokens end inside "ö" (bytes)

    def decode(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    reader = ChunkReader("r1-1", 3, len(made), text=ResumeText(decode, made, len("héllo w")))
    line = 'data: {"choices":[{"text":"PROMPT TEXT!","token_ids":[%d]}]}'
    deltas = feed_all(reader, [line % "ö".encode()[-1], line % "é".encode()[0]])
    deltas += feed_all(reader, [line % "é".encode()[1], line % 33])
    assert "".join(d.delta_text for d in deltas) == "öé!"
    assert [d.num_output_tokens for d in deltas] == [len(made) + i for i in range(1, 5)]


def test_an_error_event_ends_the_request_not_the_backend() -> None:
    reader = ChunkReader("r1", num_prompt=3)
    (delta,) = feed_all(
        reader, ['data: {"error": {"message": "Internal server error", "type": "x", "code": 500}}']
    )
    assert (delta.finished, delta.finish_reason, delta.error) == (
        True,
        "error",
        "Internal server error",
    )
    assert delta.failure is None  # a request-level failure: the replica stays routable
    assert reader.finished


def test_an_error_event_vllm_answers_as_a_4xx_is_the_requests_fault() -> None:
    reader = ChunkReader("r1", num_prompt=3)
    line = (
        'data: {"error": {"message": "Token id 9 is out of vocabulary", "type": "x", "code": 400}}'
    )
    (delta,) = feed_all(reader, [line])
    assert (delta.finish_reason, delta.failure) == ("error", "invalid")


def test_done_without_a_finish_reason_is_an_error_not_a_hang() -> None:
    reader = ChunkReader("r1", num_prompt=3)
    (delta,) = feed_all(reader, ["data: [DONE]"])
    assert (delta.finished, delta.finish_reason) == (True, "error")


def test_a_line_that_is_not_a_chunk_is_refused() -> None:
    with pytest.raises(MalformedChunkError):
        ChunkReader("r1", 3).feed("data: {not json")
    assert ChunkReader("r1", 3).feed(": a comment") is None


def test_the_body_sends_token_ids_salt_and_sampling() -> None:
    req = GenerateRequest(
        request_id="r1",
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(
            max_tokens=20, temperature=0, top_k=5, seed=7, stop=["x"], min_tokens=4, logprobs=2
        ),
        cache_salt="tenant-salt",
    )
    body = completion_body(req, "tiny")
    assert body is not None
    assert body["prompt"] == PROMPT and body["model"] == "tiny"
    assert (body["max_tokens"], body["min_tokens"], body["top_k"], body["seed"]) == (20, 4, 5, 7)
    assert body["cache_salt"] == "tenant-salt" and body["stop"] == ["x"]
    assert body["stream"] and body["return_token_ids"]
    assert body["stream_options"] == {"include_usage": True}
    assert body["logprobs"] == 2 and body["return_tokens_as_token_ids"]
    assert not {"presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"} & set(
        body
    )
    penalized = SamplingParams(
        presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, logit_bias={65: 3.0}
    )
    body = completion_body(GenerateRequest(request_id="r2", prompt_token_ids=PROMPT,
                                           sampling=penalized), "tiny")  # fmt: skip
    assert body is not None
    assert (body["presence_penalty"], body["frequency_penalty"]) == (0.5, -1)
    assert body["repetition_penalty"] == 1.2 and body["logit_bias"] == {"65": 3.0}


def test_a_resume_continues_from_the_streamed_tokens() -> None:
    req = GenerateRequest(
        request_id="r1-1",
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(max_tokens=20, temperature=0, min_tokens=4),
        resume=Resume(output_token_ids=[9, 8, 7, 6, 5, 4]),
    )
    body = completion_body(req, "tiny")
    assert body is not None
    assert body["prompt"] == [*PROMPT, 9, 8, 7, 6, 5, 4]
    assert body["max_tokens"] == 14 and "min_tokens" not in body
    done = GenerateRequest(
        request_id="r1-1",
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(max_tokens=3),
        resume=Resume(output_token_ids=[1, 2, 3]),
    )
    assert completion_body(done, "tiny") is None


METRICS = """\
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
process_start_time_seconds 1.79562155477e+09
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:cache_config_info{block_size="32",enable_prefix_caching="True",engine="0",\
num_gpu_blocks="512",prefix_caching_hash_algo="sha256_cbor"} 1.0
"""
MODELS = {"data": [{"id": "tiny", "root": "/models/tiny", "max_model_len": 2048}]}
SPEC = BackendSpec.parse("http://10.0.0.5:8000=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558")


def test_a_backend_is_described_by_its_own_endpoints() -> None:
    m = parse_metrics(METRICS)
    info = build_info(SPEC, MODELS, m, topic="kv", hash_seed="vllm-none-hash", block_size=None)
    assert (info.replica_id, info.model, info.model_path) == (
        "10.0.0.5:8000",
        "tiny",
        "/models/tiny",
    )
    assert (info.block_size, info.num_blocks, info.max_model_len) == (32, 512, 2048)
    assert (info.hash_algo, info.hash_form) == ("sha256_cbor_tagged", "int")
    assert info.replay_endpoint == "tcp://10.0.0.5:5558"
    assert info.incarnation.endswith("@1.79562155477e+09")
    report = load_report(m, info.block_size)
    assert (report.num_running, report.num_waiting) == (2, 1)
    assert (report.free_blocks, report.total_blocks) == (384, 512)


@pytest.mark.parametrize(
    ("metrics", "block_size", "says"),
    [
        (
            METRICS.replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"'),
            None,
            "--enable-prefix-caching",
        ),
        (METRICS, 16, "block size is 32"),
        ("process_start_time_seconds 1.0\n", None, "--block-size"),
    ],
)
def test_a_backend_kvroute_cannot_hash_for_is_refused(
    metrics: str, block_size: int | None, says: str
) -> None:
    with pytest.raises(BackendError, match=says):
        build_info(
            SPEC, MODELS, parse_metrics(metrics), topic="", hash_seed="s", block_size=block_size
        )


@pytest.mark.parametrize(
    ("algo", "reported"), [("sha256", "vllm:sha256"), ("xxhash", "vllm:xxhash")]
)
def test_a_backend_whose_hash_kvroute_cannot_reproduce_is_indexed_by_token_ids(
    algo: str, reported: str
) -> None:
    """vLLM's default sha256 (a pickle) is not refused: the router re-hashes its events'
    token ids (events/translate.py), so only its block size must agree."""
    m = parse_metrics(METRICS.replace('"sha256_cbor"', f'"{algo}"'))
    info = build_info(SPEC, MODELS, m, topic="", hash_seed="s", block_size=32)
    assert info.hash_algo == reported
    with pytest.raises(BackendError, match="block size is 32"):
        build_info(SPEC, MODELS, m, topic="", hash_seed="s", block_size=16)


def test_backend_specs() -> None:
    assert SPEC.events_endpoint == "tcp://10.0.0.5:5557"
    assert BackendSpec.parse("http://h:1=tcp://h:2").replay_endpoint is None
    for bad in ("http://h:1", "h:1=tcp://h:2", "http://h:1=h:2"):
        with pytest.raises(ValueError, match="--backend"):
            BackendSpec.parse(bad)


def test_metrics_are_summed_over_engines_wherever_their_lines_are() -> None:
    """Data-parallel engines' gauges summed (KV use: the fullest), lines found at the very
    start or end of the text, with CRLF endings, never inside another metric's name."""
    text = (
        'vllm:num_requests_running{engine="0"} 2.0\r\n'
        '# vllm:num_requests_running{engine="9"} 50.0\n'
        'x_vllm:num_requests_waiting{engine="9"} 70.0\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
        'vllm:num_requests_waiting{engine="0"} 1.0\n'
        'vllm:num_requests_running{engine="1"} 3.5\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.25\n'
        'vllm:num_requests_waiting{engine="1"} 2.0\n'
        "process_start_time_seconds 6.5"
    )
    m = parse_metrics(text)
    assert (m.running, m.waiting, m.kv_usage, m.start_time) == (5.5, 3.0, 0.5, "6.5")
    assert parse_metrics("") == parse_metrics("\n") == parse_metrics("# nothing\n")
