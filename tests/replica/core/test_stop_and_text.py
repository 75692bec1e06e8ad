"""Stopping and text: stop strings, stop token ids, length, and streamed text deltas.

Why stop strings are found from the model's own greedy output: the tiny model's weights are
random, so the only way to know a string will appear is to look first. The detokenizer is
also tested alone, on text chosen to hit its hard cases (multi-byte characters split over
byte tokens, stop strings spanning tokens).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest
from transformers import AutoTokenizer

from kvroute.replica import EngineConfig, LLMEngine, RequestOutput, SamplingParams, tiny_model_path
from kvroute.replica.core.detokenizer import IncrementalDetokenizer

N = 24
PROMPTS = ["Once upon a time", "kvroute", "The answer is", "x = 1; y =", "hello world", "abc"]
_ids = itertools.count()


@dataclass
class Run:
    final: RequestOutput
    deltas: list[str]
    delta_ids: list[int]
    streamed: list[str]  # the concatenated text after each step

    @property
    def text(self) -> str:
        return self.final.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return list(self.final.outputs[0].token_ids)


@pytest.fixture(scope="module")
def engine(tiny_engine: LLMEngine) -> LLMEngine:
    return tiny_engine


def run_all(engine: LLMEngine, prompts: list[str], params: list[SamplingParams]) -> list[Run]:
    """Steps the engine until every request finished, recording each step's deltas."""
    rids = [f"r{next(_ids)}" for _ in prompts]
    for rid, prompt, p in zip(rids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p)
    deltas: dict[str, list[str]] = {r: [] for r in rids}
    delta_ids: dict[str, list[int]] = {r: [] for r in rids}
    streamed: dict[str, list[str]] = {r: [] for r in rids}
    finals: dict[str, RequestOutput] = {}
    for _ in range(10 * N):
        if len(finals) == len(rids):
            break
        for out in engine.step():
            rid = out.request_id
            assert rid not in finals, "an output after the final one"
            deltas[rid].append(out.delta_text)
            delta_ids[rid].extend(out.delta_token_ids)
            streamed[rid].append("".join(deltas[rid]))
            if out.finished:
                finals[rid] = out
    assert len(finals) == len(rids), "requests did not finish"
    return [Run(finals[r], deltas[r], delta_ids[r], streamed[r]) for r in rids]


def greedy(max_tokens: int = N, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def baseline(engine: LLMEngine) -> list[Run]:
    """Unstopped greedy runs of every prompt."""
    return run_all(engine, PROMPTS, [greedy()] * len(PROMPTS))


def assert_stream_consistent(run: Run) -> None:
    assert "".join(run.deltas) == run.text
    assert run.delta_ids == run.token_ids
    for so_far in run.streamed:
        assert run.text.startswith(so_far)


def test_streamed_text_is_the_decoded_output(engine: LLMEngine, baseline: list[Run]) -> None:
    for run in baseline:
        assert run.final.outputs[0].finish_reason == "length"
        assert len(run.token_ids) == N
        assert run.text == engine.tokenizer.decode(run.token_ids, skip_special_tokens=True)
        assert_stream_consistent(run)


def find_stop(engine: LLMEngine, baseline: list[Run], width: int) -> tuple[int, str, int, int]:
    """(prompt index, stop string, char offset, tokens up to and including the stop's end).

    A run of ``width`` printable ASCII tokens, so the string has a clean token boundary.
    """
    for i, run in enumerate(baseline):
        ids = run.token_ids
        for j in range(2, len(ids) - width - 2):
            window = ids[j : j + width]
            if all(32 < t < 127 for t in window):
                stop = bytes(window).decode()
                prefix = engine.tokenizer.decode(ids[:j], skip_special_tokens=True)
                if run.text.find(stop) == len(prefix):
                    return i, stop, len(prefix), j + width
    pytest.fail("no greedy output holds a printable ASCII run to use as a stop string")


def test_stop_string_cuts_before_it_and_streams_none_of_it(
    engine: LLMEngine, baseline: list[Run]
) -> None:
    i, stop, at, _ = find_stop(engine, baseline, width=3)
    decoy = "\x00never"  # a second stop string that never matches: the earliest match wins
    (run,) = run_all(engine, [PROMPTS[i]], [greedy(stop=[decoy, stop])])
    out = run.final.outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == baseline[i].text[:at]
    assert stop not in out.text
    assert_stream_consistent(run)
    # Nothing of the stop string was ever streamed, not even its first character.
    for so_far in run.streamed:
        assert len(so_far) <= at


def test_stop_string_completed_by_the_last_allowed_token_is_a_stop(
    engine: LLMEngine, baseline: list[Run]
) -> None:
    i, stop, at, end = find_stop(engine, baseline, width=2)
    (run,) = run_all(engine, [PROMPTS[i]], [greedy(max_tokens=end, stop=[stop])])
    out = run.final.outputs[0]
    assert out.text == baseline[i].text[:at]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_stop_token_id_ends_the_request_and_stays_out_of_the_text(
    engine: LLMEngine, baseline: list[Run]
) -> None:
    ids = baseline[0].token_ids
    k = 3
    while ids[k] in ids[:k]:  # the stop must be the first occurrence of its token
        k += 1
    (run,) = run_all(engine, [PROMPTS[0]], [greedy(stop_token_ids=[ids[k]])])
    out = run.final.outputs[0]
    assert out.token_ids == ids[: k + 1]  # the stop token is in token_ids (as in vLLM)...
    assert (out.finish_reason, out.stop_reason) == ("stop", ids[k])
    # ...but not in the text (vLLM and OpenAI leave the stop out of the completion).
    assert out.text == engine.tokenizer.decode(ids[:k], skip_special_tokens=True)
    assert_stream_consistent(run)


def test_stop_token_id_text_is_the_same_without_streaming(baseline: list[Run]) -> None:
    """The non-streaming engine decodes once at the end: the same text rules apply."""
    quiet = LLMEngine(EngineConfig(model="tiny", num_blocks=64, stream_text=False))
    ids = baseline[0].token_ids
    k = 3
    while ids[k] in ids[:k]:
        k += 1
    (run,) = run_all(quiet, [PROMPTS[0]], [greedy(stop_token_ids=[ids[k]])])
    assert run.token_ids == ids[: k + 1]
    assert run.text == quiet.tokenizer.decode(ids[:k], skip_special_tokens=True)
    assert "".join(run.deltas) == run.text


def test_max_tokens_ends_with_length(engine: LLMEngine, baseline: list[Run]) -> None:
    (run,) = run_all(engine, [PROMPTS[1]], [greedy(max_tokens=3)])
    out = run.final.outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("length", None)
    assert out.token_ids == baseline[1].token_ids[:3]
    assert_stream_consistent(run)


# -- the detokenizer alone ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_model_path())


TEXT = "héllo 😀 wörld ∑ ok"


def feed(detok: IncrementalDetokenizer, ids: list[int], chunk: int) -> list[str]:
    deltas = []
    for k in range(0, len(ids), chunk):
        deltas.append(detok.update(ids[k : k + chunk]))
    deltas.append(detok.update([], finished=True))
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_detokenizer_never_emits_half_a_character(tokenizer, chunk: int) -> None:
    ids = tokenizer(TEXT).input_ids
    assert ids == list(TEXT.encode())  # byte-level: é, 😀, ö and ∑ span 2-4 tokens
    detok = IncrementalDetokenizer(tokenizer)
    deltas = feed(detok, ids, chunk)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT == detok.text
    if chunk == 1:  # and nothing waits longer than its character needs
        data = TEXT.encode()
        for n in range(1, len(data) + 1):
            assert "".join(deltas[:n]) == data[:n].decode(errors="ignore")


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        ("😀 w", "héllo "),  # spans the 4 bytes of the emoji and two more tokens
        ("llo", "hé"),
        ("ö", "héllo 😀 w"),  # a stop that is one multi-byte character
        ("∑ ok", "héllo 😀 wörld "),  # ends on the very last token
    ],
)
@pytest.mark.parametrize("chunk", [1, 4])
def test_detokenizer_stop_strings_across_tokens(
    tokenizer, stop: str, expected: str, chunk: int
) -> None:
    detok = IncrementalDetokenizer(tokenizer, [stop, "never seen"])
    ids = tokenizer(TEXT).input_ids
    deltas = []
    for k in range(0, len(ids), chunk):
        deltas.append(detok.update(ids[k : k + chunk]))
        # Nothing past the cut is ever handed out, not even the stop's first characters.
        assert expected.startswith("".join(deltas))
        if detok.stop_string is not None:
            break
    assert detok.stop_string == stop
    deltas.append(detok.flush())
    assert "".join(deltas) == expected == detok.text


def test_detokenizer_releases_a_held_back_partial_match(tokenizer) -> None:
    """Text that looked like the start of a stop string comes out once it cannot be one."""
    detok = IncrementalDetokenizer(tokenizer, ["wörk"])
    deltas = feed(detok, tokenizer(TEXT).input_ids, 1)
    assert detok.stop_string is None
    assert "".join(deltas) == TEXT


@pytest.mark.parametrize("stream", [True, False], ids=["decode-stream", "window"])
def test_detokenizer_text_is_the_whole_decode_even_of_broken_utf8(tokenizer, stream: bool) -> None:
    """Random bytes: characters split across tokens, sequences that never complete, and
    requests that finish in the middle of one. Both ways of decoding give exactly what
    decoding the whole output at once gives."""
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(3, 256) for _ in range(rng.randrange(1, 80))]
        chunk = rng.choice([1, 1, 2, 3])
        detok = IncrementalDetokenizer(tokenizer, stream=stream)
        assert detok.incremental == stream  # the path under test is the one taken
        deltas = [detok.update(ids[k : k + chunk]) for k in range(0, len(ids), chunk)]
        deltas.append(detok.update([], finished=True))
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == detok.text


@pytest.fixture(scope="module")
def byte_fallback_tokenizer():
    """A SentencePiece-style tokenizer as Llama 2, Mistral and Gemma ship them: words with
    "▁" for a space, and byte tokens <0x00>..<0xFF> for what the vocabulary lacks."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for word in ["▁Hello", "▁world", "B", "▁ok", "é"]:
        vocab[word] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, clean_up_tokenization_spaces=False,
        bos_token="<s>", eos_token="</s>", unk_token="<unk>",
    )  # fmt: skip


@pytest.mark.parametrize("stream", [True, False], ids=["decode-stream", "window"])
def test_byte_fallback_bytes_that_never_form_utf8_do_not_fail_the_request(
    byte_fallback_tokenizer, stream: bool
) -> None:
    """``DecodeStream`` raises on byte tokens that can no longer become a character (a lone
    lead byte followed by a word). The request must go on: its deltas add up to its text, a
    failover's ``resume`` over the same tokens rebuilds the same text (the offsets of what
    was sent must hold), and where the bytes do form UTF-8 the text is the whole decode's.
    (Where they do not, no incremental decode matches the whole one: ByteFallback turns
    every byte of an invalid run into U+FFFD, a run that grows as tokens arrive.)"""
    tok = byte_fallback_tokenizer
    words = [tok.convert_tokens_to_ids(w) for w in ["▁Hello", "▁world", "B", "▁ok", "é"]]
    rng = random.Random(1)
    cases = [[words[0], 3 + 0xC3, 3 + 0xA9, 3 + 0xE2, words[2]]]  # é by bytes, then a lone lead
    for _ in range(300):
        cases.append(
            [rng.choice(words) if rng.random() < 0.4 else 3 + rng.randrange(256)
             for _ in range(rng.randrange(1, 30))]
        )  # fmt: skip
    for text in ["é ok", "Hello wörld ∑ 😀"]:  # valid UTF-8, all of it in bytes but spaces
        cases.append([3 + b for b in text.encode()])
    valid = 0
    for ids in cases:
        whole = tok.decode(ids, skip_special_tokens=True)
        detok = IncrementalDetokenizer(tok, stream=stream)
        assert detok.incremental == stream
        deltas = [detok.update([t]) for t in ids] + [detok.update([], finished=True)]
        assert "".join(deltas) == detok.text, ids
        again = IncrementalDetokenizer(tok, stream=stream)
        again.resume(ids, 0)
        again.update([], finished=True)
        assert again.text == detok.text, ids
        if "\ufffd" not in whole:
            valid += 1
            assert detok.text == whole, ids
    assert valid >= 20  # the comparison with the whole decode did happen
