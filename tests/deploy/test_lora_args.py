"""``kvroute serve``'s LoRA flags: vLLM's forms parsed into every replica's engine config,
mistakes refused in one line naming the flag, before Ray starts."""

from __future__ import annotations

import pytest

from kvroute.deploy.cli import build_parser
from kvroute.deploy.lora_args import LoRAFlagError, lora_settings, parse_lora_module


def settings(*argv: str) -> dict[str, object]:
    args = build_parser().parse_args(["serve", "--model", "tiny", *argv])
    return lora_settings(args)


def test_both_forms_of_lora_modules_reach_the_engine_config() -> None:
    got = settings(
        "--lora-modules",
        "a=/x/a",
        '{"name": "b", "path": "/x/b", "base_model_name": "tiny"}',
        "--max-loras", "2", "--max-cpu-loras", "4", "--max-lora-rank", "64",
    )  # fmt: skip
    assert got == {
        "enable_lora": True,
        "lora_modules": {"a": "/x/a", "b": "/x/b"},
        "max_loras": 2,
        "max_cpu_loras": 4,
        "max_lora_rank": 64,
    }
    assert settings("--enable-lora") == {"enable_lora": True, "lora_modules": {}}
    assert settings() == {}  # LoRA off: the engine config is untouched


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--lora-modules", "nopath"], "--lora-modules"),
        (["--lora-modules", "=/x"], "--lora-modules"),
        (["--lora-modules", "a="], "--lora-modules"),
        (["--lora-modules", '{"name": "a"}'], "--lora-modules"),
        (["--lora-modules", '{"name": "a", "path": "/x", "rank": 4}'], "--lora-modules"),
        (["--lora-modules", '{"name": "a", "path": "/x", "base_model_name": "llama"}'],
         "--lora-modules"),
        (["--lora-modules", "a=/x", "a=/y"], "--lora-modules"),
        (["--lora-modules", "a\x00b=/x"], "--lora-modules"),  # a /metrics label
        (["--lora-modules", '{"name": "a\\u001bb", "path": "/x"}'], "--lora-modules"),
        (["--max-loras", "2"], "--max-loras"),  # without --enable-lora
        (["--enable-lora", "--max-loras", "0"], "--max-loras"),
        (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "--max-cpu-loras"),
    ],
)  # fmt: skip
def test_a_bad_flag_is_refused_naming_it(argv: list[str], flag: str) -> None:
    with pytest.raises(LoRAFlagError) as info:
        settings(*argv)
    assert str(info.value).startswith(flag), str(info.value)
    assert "\n" not in str(info.value)


def test_vllm_replicas_get_vllm_s_own_engine_arguments() -> None:
    got = settings("--engine", "vllm", "--lora-modules", "a=/x/a", "--max-loras", "3")
    assert got == {
        "lora_modules": {"a": "/x/a"},
        "engine_args": {"enable_lora": True, "max_loras": 3},
    }


def test_a_json_module_may_name_the_served_name() -> None:
    item = '{"name": "a", "path": "/x", "base_model_name": "served"}'
    assert parse_lora_module(item, ["tiny", "served"]) == ("a", "/x")
    assert parse_lora_module(" a = /x ") == ("a", "/x")
