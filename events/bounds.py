"""Request bounds: one definition, checked by the front door (a 400 naming the field) and
again by the engine (the last line of defence).

Why one module for both sides: a value past these bounds must never reach torch, where it
would fail a step that every request of the batch shares (a seed of 2**70 once killed whole
engines). The front door refuses it with the field named; ``SamplingParams`` (one type, built by the
front door, carried over Ray, run by the engine) refuses it again with the same words when
built, decoded or received by a replica. This module imports nothing heavy (no ray, no
torch), so the parameters stay cheap to import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

SEED_MIN = -(2**63)  # OpenAI documents `seed` as an int64; torch's Generator takes
SEED_MAX = 2**63 - 1  # [-2**63, 2**64) and raises past it (the seed 2**70 "query of death")
TOKEN_ID_MAX = 2**32 - 1  # block hashing packs token ids as uint32
MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512  # the detokenizer holds back this many characters while streaming
MAX_STOP_TOKEN_IDS = 256
MAX_PENALTY = 2.0  # OpenAI's bound on presence_penalty and frequency_penalty (either sign)
MAX_REPETITION_PENALTY = 10.0  # vLLM takes any value > 0; past this every seen token is gone
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each logit_bias value (either sign)
MAX_LOGIT_BIAS_TOKENS = 1024  # entries per request: a bias is a scatter per row and step
MAX_STRUCTURED_CHARS = 64 << 10  # a schema, regex or grammar: compiled on the replica
MAX_CHOICES_STRUCTURED = 1024  # alternatives of a ``choice`` constraint


class BoundsError(ValueError):
    """A request field outside the shared bounds; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray: keep both arguments
        return (type(self), (self.param, str(self).partition(": ")[2]))


_INT_ONLY = {int}


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def check_sampling(p: Any) -> None:
    """Raises :class:`BoundsError` unless ``p`` (a :class:`SamplingParams`, the engine's
    ``SamplingParams`` or anything with their fields) is within the shared bounds."""
    if not _is_int(p.max_tokens) or p.max_tokens < 1:
        raise BoundsError("max_tokens", f"must be an int >= 1, got {p.max_tokens!r}")
    if not _is_number(p.temperature) or p.temperature < 0:
        raise BoundsError("temperature", f"must be a finite number >= 0, got {p.temperature!r}")
    if not _is_number(p.top_p) or not 0.0 < p.top_p <= 1.0:
        raise BoundsError("top_p", f"must be a number in (0, 1], got {p.top_p!r}")
    if not _is_int(p.top_k) or p.top_k < -1:
        raise BoundsError("top_k", f"must be an int >= 0 (0 or -1: off), got {p.top_k!r}")
    if p.seed is not None and (not _is_int(p.seed) or not SEED_MIN <= p.seed <= SEED_MAX):
        raise BoundsError("seed", f"must be an int in [{SEED_MIN}, {SEED_MAX}], got {p.seed!r}")
    stop = p.stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS:
        raise BoundsError("stop", f"must be a list of at most {MAX_STOP_STRINGS} strings")
    for s in stop:
        if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
            raise BoundsError("stop", f"must hold strings of 1 to {MAX_STOP_CHARS} characters")
        check_text(s, "stop")
    ids = p.stop_token_ids
    if not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS:
        raise BoundsError("stop_token_ids", f"must be a list of at most {MAX_STOP_TOKEN_IDS}")
    for t in ids:
        if not _is_int(t) or not 0 <= t <= TOKEN_ID_MAX:
            raise BoundsError("stop_token_ids", f"must hold ints in [0, {TOKEN_ID_MAX}]")
    if not isinstance(p.ignore_eos, bool):
        raise BoundsError("ignore_eos", f"must be a bool, got {p.ignore_eos!r}")
    if not _is_int(p.min_tokens) or not 0 <= p.min_tokens <= p.max_tokens:
        raise BoundsError(
            "min_tokens", f"must be an int in [0, max_tokens={p.max_tokens}], got {p.min_tokens!r}"
        )
    if p.logprobs is not None and (not _is_int(p.logprobs) or not 0 <= p.logprobs <= MAX_LOGPROBS):
        raise BoundsError("logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}]")
    k = getattr(p, "prompt_logprobs", None)
    if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
        raise BoundsError("prompt_logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}]")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name, 0.0)
        if not _is_number(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
            bound = f"[-{MAX_PENALTY}, {MAX_PENALTY}]"
            raise BoundsError(name, f"must be a number in {bound}, got {v!r}")
    v = getattr(p, "min_p", 0.0)
    if not _is_number(v) or not 0.0 <= v <= 1.0:
        raise BoundsError("min_p", f"must be a number in [0, 1], got {v!r}")
    bias = getattr(p, "logit_bias", None)
    if bias is not None:
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_TOKENS:
            raise BoundsError(
                "logit_bias", f"must map at most {MAX_LOGIT_BIAS_TOKENS} token ids to biases"
            )
        for t, b in bias.items():
            if not _is_int(t) or not 0 <= t <= TOKEN_ID_MAX:
                raise BoundsError("logit_bias", f"token ids must be ints in [0, {TOKEN_ID_MAX}]")
            if not _is_number(b) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                raise BoundsError(
                    "logit_bias", f"biases must be numbers in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]"
                )
    v = getattr(p, "repetition_penalty", 1.0)
    if not _is_number(v) or not 0.0 < v <= MAX_REPETITION_PENALTY:
        raise BoundsError(
            "repetition_penalty", f"must be a number in (0, {MAX_REPETITION_PENALTY}], got {v!r}"
        )
    so = getattr(p, "structured_outputs", None)
    if so is not None:
        check_structured(so)


def check_structured(so: Any) -> None:
    """Exactly one constraint, of bounded size (vLLM's ``StructuredOutputsParams`` fields)."""
    param = "structured_outputs"
    kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(so, k) is not None]
    if so.json_object:
        kinds.append("json_object")
    if len(kinds) != 1:
        raise BoundsError(
            param, "must set exactly one of json, json_object, regex, choice, grammar"
        )
    for k in ("json", "regex", "grammar"):
        v = getattr(so, k)
        if v is not None:
            if not isinstance(v, str) or not 0 < len(v) <= MAX_STRUCTURED_CHARS:
                raise BoundsError(param, f"{k} must be text of 1 to {MAX_STRUCTURED_CHARS} chars")
            check_text(v, param)
    if so.choice is not None:
        c = so.choice
        if not isinstance(c, list) or not 0 < len(c) <= MAX_CHOICES_STRUCTURED:
            raise BoundsError(param, f"choice must list 1 to {MAX_CHOICES_STRUCTURED} strings")
        if any(not isinstance(x, str) for x in c) or sum(map(len, c)) > MAX_STRUCTURED_CHARS:
            limit = MAX_STRUCTURED_CHARS
            raise BoundsError(param, f"choice must hold strings, {limit} chars in all")
        for x in c:
            check_text(x, param)


def check_text(text: str, param: str) -> None:
    """Text must encode as UTF-8: a lone surrogate (valid in JSON's ``\\ud800``, not in
    UTF-8) fails every tokenizer and encoder downstream."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BoundsError(param, "must be valid Unicode (no lone surrogates)") from None


def check_prompt_token_ids(
    token_ids: Sequence[Any], vocab_size: int | None, param: str = "prompt"
) -> None:
    """Raises :class:`BoundsError` (naming ``param``) unless the ids are a non-empty list of
    ints in ``[0, vocab_size)`` (``[0, TOKEN_ID_MAX]`` when the vocabulary is not known): one
    id out of range would fail the model forward that every request of the step shares."""
    if not token_ids:
        raise BoundsError(param, f"the {param} is empty")
    limit = TOKEN_ID_MAX + 1 if vocab_size is None else min(vocab_size, TOKEN_ID_MAX + 1)
    # The usual prompt, a list of plain ints, checked by C builtins (type, min, max) with no
    # Python loop per id; any other element type, or an id out of range, takes the loop,
    # which names the culprit.
    if set(map(type, token_ids)) == _INT_ONLY and min(token_ids) >= 0 and max(token_ids) < limit:
        return
    for t in token_ids:
        if not _is_int(t) or not 0 <= t < limit:
            raise BoundsError(param, f"token ids must be ints in [0, {limit}), got {t!r}")
