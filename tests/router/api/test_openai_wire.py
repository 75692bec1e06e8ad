"""The msgspec twins of the request models (router/api/openai_wire.py) against the models.

The front door decodes a body with the twin first and hands it to pydantic only when the
twin refuses it. So a twin must never accept what its model refuses, must decode what both
accept to the same values, and must declare every field its model has.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.events.replica_api import MAX_STOP_CHARS, SEED_MAX, TOKEN_ID_MAX
from kvroute.router.api.errors import APIError
from kvroute.router.api.openai_api import ChatCompletionRequest, CompletionRequest
from kvroute.router.api.openai_wire import DECODERS, TWINS, decode_body

MODELS = (CompletionRequest, ChatCompletionRequest)

# Values any field may get: right and wrong types, bounds and their neighbours.
ANY_VALUE = st.sampled_from(
    [
        None, True, False, 0, 1, -1, -2, 2, 3, 5, 16, 2**31, 2**63, 2**70, SEED_MAX + 1,
        TOKEN_ID_MAX, TOKEN_ID_MAX + 1, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5, -0.5, 1e308,
        "", "a", "m", "text", "none", "\ud800", "\udc00x", "é", "x" * (MAX_STOP_CHARS + 1),
        [], [1, 2], [0], [-1], [True], [1.0], ["a"], [""], ["a"] * 17, [TOKEN_ID_MAX + 1],
        {}, {"include_usage": True}, {"include_usage": "yes"}, {"include_usage": None},
        {"type": "text"}, {"a": 1},
    ]
)  # fmt: skip
PART = st.fixed_dictionaries(
    {"type": st.just("text"), "text": st.sampled_from(["hi", ""])},
    optional={"extra": ANY_VALUE},
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer"])},
    optional={
        "content": st.one_of(st.sampled_from(["hi", "", None]), st.lists(PART, max_size=3)),
        "name": st.sampled_from(["n", None]),
    },
)
# Values each field takes in a valid body (bounds included).
VALID: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just("m"),
    "prompt": st.one_of(
        st.sampled_from(["hi", ""]), st.lists(st.integers(0, TOKEN_ID_MAX), min_size=1)
    ),
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "max_tokens": st.sampled_from([None, -1, 0, 1, 16, 2**40]),
    "max_completion_tokens": st.sampled_from([None, 1, 7]),
    "temperature": st.sampled_from([None, 0, 0.0, 0.7, 1, 2.0]),
    "top_p": st.sampled_from([None, 1, 1.0, 0.1]),
    "top_k": st.sampled_from([None, -1, 0, 50]),
    "min_p": st.sampled_from([None, 0, 0.05, 1.0]),
    "seed": st.sampled_from([None, 0, -1, 7, SEED_MAX]),
    "stop": st.one_of(
        st.sampled_from([None, "a", "\n"]), st.lists(st.sampled_from(["a", "\n"]), max_size=3)
    ),
    "stop_token_ids": st.sampled_from([None, [], [1, 2]]),
    "stream": st.sampled_from([None, True, False]),
    "stream_options": st.sampled_from([None, {}, {"include_usage": True}, {"x": 1}]),
    "user": st.sampled_from([None, "u"]),
    "cache_salt": st.sampled_from([None, "s", "x" * 256]),
    "ignore_eos": st.sampled_from([None, True, False]),
    "min_tokens": st.sampled_from([None, 0, 3]),
    "presence_penalty": st.sampled_from([None, 0, -2, 2.0, 0.5]),
    "frequency_penalty": st.sampled_from([None, 0.0, -1.5, 2]),
    "repetition_penalty": st.sampled_from([None, 1, 1.0, 0.5, 10]),
    "logit_bias": st.sampled_from([None, {}, {"5": 1.0}, {"65": -100, "1": 100}]),
    "echo": st.sampled_from([None, False, True]),
    "suffix": st.sampled_from([None, "", "s"]),
    "logprobs": st.sampled_from([None, 0, 5, True, False]),
    "top_logprobs": st.sampled_from([None, 0, 2]),
    "parallel_tool_calls": st.sampled_from([None, True]),
}
NEUTRAL_OR_NOT = st.sampled_from([None, 0, 1, 2, 0.0, 1.0, 0.5, "none", "", [], {}, {"a": 1}])


def body_strategy(model: type[pydantic.BaseModel]) -> st.SearchStrategy[dict[str, Any]]:
    """A valid-looking body, then up to three fields (or an unknown one) given any value:
    mostly bodies both accept or only one field away from it."""
    key = "prompt" if model is CompletionRequest else "messages"
    optional = {
        n: VALID.get(n, NEUTRAL_OR_NOT) for n in model.model_fields if n not in ("model", key)
    }
    base = st.fixed_dictionaries({"model": VALID["model"], key: VALID[key]}, optional=optional)
    names = [*model.model_fields, "unknown_field"]
    mutations = st.dictionaries(st.sampled_from(names), ANY_VALUE, max_size=3)
    dropped = st.sets(st.sampled_from(["model", key]), max_size=1)
    return st.builds(
        lambda body, mut, drop: {k: v for k, v in {**body, **mut}.items() if k not in drop},
        base, mutations, dropped,
    )  # fmt: skip


def normalized(value: Any) -> Any:
    """Builtins with only declared fields (pydantic keeps a content part's extras)."""
    if isinstance(value, pydantic.BaseModel):
        return {name: normalized(getattr(value, name)) for name in type(value).model_fields}
    if isinstance(value, msgspec.Struct):
        return {name: normalized(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, list):
        return [normalized(v) for v in value]
    return value


def check(model: type[pydantic.BaseModel], raw: bytes) -> bool:
    """The twin's verdict agrees with the model's; True when the twin accepted."""
    try:
        fast = DECODERS[model](raw)
    except ValueError:  # as the front door: msgspec's errors and UnicodeDecodeError
        fast = None
    try:
        slow = model.model_validate_json(raw)
    except pydantic.ValidationError:
        assert fast is None, f"the twin accepted what {model.__name__} refuses: {raw!r}"
        return False
    if fast is not None:
        assert normalized(fast) == normalized(slow), raw
        assert fast.unsupported() == slow.unsupported(), raw
        assert fast.stop_list() == slow.stop_list(), raw
        assert fast.num_logprobs() == slow.num_logprobs(), raw
        assert fast.chat == slow.chat
    return fast is not None


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_twin_declares_every_field(model: type[pydantic.BaseModel]) -> None:
    twin = TWINS[model]
    assert set(twin.__struct_fields__) == set(model.model_fields)
    for name, info in model.model_fields.items():
        field = next(f for f in msgspec.structs.fields(twin) if f.name == name)
        assert field.required == info.is_required(), name
        if not field.required:
            assert field.default == info.default, name


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_twin_never_accepts_more(model: type[pydantic.BaseModel], data: st.DataObject) -> None:
    body = data.draw(body_strategy(model))
    check(model, json.dumps(body).encode())


COMMON = [
    (CompletionRequest, {"model": "m", "prompt": "Hello", "max_tokens": 8, "stream": True}),
    (CompletionRequest, {"model": "m", "prompt": list(range(512)), "max_tokens": 4,
                         "stream": True, "stream_options": {"include_usage": True},
                         "temperature": 0.0, "ignore_eos": True, "repetition_penalty": 1.0}),
    (CompletionRequest, {"model": "m", "prompt": "a", "stop": ["\n", "."], "seed": 7,
                         "logprobs": 2, "top_p": 0.9, "top_k": -1, "n": 1, "user": "u"}),
    (ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "max_completion_tokens": 5, "stream": True, "logprobs": True, "top_logprobs": 2,
        "cache_salt": "tenant-a", "stop": "\n", "min_tokens": 1}),
]  # fmt: skip


@pytest.mark.parametrize(("model", "body"), COMMON)
def test_common_bodies_take_the_fast_path(model: type[pydantic.BaseModel], body: dict) -> None:
    assert check(model, json.dumps(body).encode())


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m","prompt":"\xed\xa0\x80"}',  # a raw (UTF-8 encoded) surrogate
        b'{"model":"m","prompt":"\\ud800"}',
        b'{"model":"m","prompt":"a\\udc00"}',
        b'{"model":"m","prompt":"a","max_tokens":5,"max_tokens":"x"}',
        b'{"model":"m","prompt":"a"} trailing',
        b'\xef\xbb\xbf{"model":"m","prompt":"a"}',
        b'{"model":"m","prompt":[1,2],"temperature":1e400}',
        b'[{"model":"m","prompt":"a"}]',
    ],
)
def test_edge_bodies_agree(raw: bytes) -> None:
    check(CompletionRequest, raw)


DEEP = b"[" * 1000 + b"]" * 1000


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m","prompt":"hi","zz":' + DEEP + b"}",  # the twin: RecursionError
        b'{"model":"m","prompt":"hi","zz":"\xff"}',
        b'{"model":"m","prompt":"hi","zz":"\xed\xa0\x80"}',
        b'{"model":"m","prompt":"hi","\x80":1}',
    ],
)
def test_the_front_door_refuses_what_pydantic_refuses_in_fields_it_ignores(raw: bytes) -> None:
    """msgspec skips unknown fields without validating them (UTF-8, depth): the front
    door's decode (openai_wire.decode_body) checks UTF-8 first and falls back on deep nesting."""
    with pytest.raises(pydantic.ValidationError):
        CompletionRequest.model_validate_json(raw)
    with pytest.raises(APIError) as info:
        decode_body(raw, CompletionRequest)
    assert info.value.status == 400


def test_usage_names_lower_tier_hits_only_when_there_are_some() -> None:
    """kvroute's extension of ``prompt_tokens_details`` (issue 38): absent for device hits
    alone, so the body stays OpenAI's."""
    from kvroute.router.api.openai_api import make_usage

    plain = make_usage(100, 5, 64).model_dump()
    assert plain["prompt_tokens_details"] == {"cached_tokens": 64}
    tiered = make_usage(100, 5, 64, {"CPU": 48}).model_dump()
    assert tiered["prompt_tokens_details"] == {
        "cached_tokens": 64,
        "cached_tokens_by_tier": {"CPU": 48},
    }
