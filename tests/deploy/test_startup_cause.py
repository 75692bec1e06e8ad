"""The one line ``kvroute serve`` prints when a replica fails to start (deploy/startup_cause.py).

Ray hands the driver only the text of an actor's failed creation: its header, the
traceback, the exception. What it proves, on Ray's real text: the line is the root
exception's type and message (pydantic's multi-line message joined, its link and input
echo dropped -- the link was all vLLM's cold-cache failure printed), the innermost explicit
cause where one exception was raised from another, and not an exception that was only
being handled; a message quoting a traceback of its own does not hide its exception.
"""

from __future__ import annotations

from typing import Any

import pydantic
import pytest
import ray

from kvroute.deploy.startup_cause import root_cause

from ..ray_session import local_ray

INSPECTED = "Model architectures ['LlamaForCausalLM'] failed to be inspected."


class ModelConfig(pydantic.BaseModel):
    architecture: str

    @pydantic.field_validator("architecture")
    @classmethod
    def inspect(cls, value: str) -> str:
        raise ValueError(INSPECTED)


def fail(kind: str) -> None:
    if kind == "pydantic":  # as vLLM's ModelConfig, while handling its subprocess's error
        try:
            raise RuntimeError("Error raised in subprocess")
        except RuntimeError:
            ModelConfig(architecture="LlamaForCausalLM")
    elif kind == "caused":
        try:
            raise OSError("no space left\non the device")
        except OSError as exc:
            raise RuntimeError("the engine did not start") from exc
    elif kind == "quoting":
        raise RuntimeError("Error raised in subprocess:\nTraceback (most recent call last):\n"
                           '  File "x.py", line 1, in <module>\nKeyError: 1\n')  # fmt: skip
    elif kind == "bare":
        raise NotImplementedError


@pytest.fixture(scope="module")
def failures() -> Any:
    with local_ray() as started:

        @ray.remote(num_cpus=0)
        class Replica:
            def __init__(self, kind: str) -> None:
                fail(kind)

            def info(self) -> None:
                return None

        def failure(kind: str) -> str:
            actor = Replica.remote(kind)
            started.append(actor)
            with pytest.raises(ray.exceptions.RayError) as caught:
                ray.get(actor.info.remote(), timeout=60)
            return str(caught.value)

        yield failure


def test_pydantics_message_is_one_line_without_its_link(failures: Any) -> None:
    text = failures("pydantic")
    assert text.splitlines()[-1].strip().startswith("For further information visit")
    assert root_cause(text) == (
        f"ValidationError: 1 validation error for ModelConfig; architecture; Value error, "
        f"{INSPECTED}"
    )


def test_the_root_is_the_innermost_explicit_cause(failures: Any) -> None:
    assert root_cause(failures("caused")) == "OSError: no space left; on the device"


def test_a_message_quoting_a_traceback_keeps_its_own_exception(failures: Any) -> None:
    line = root_cause(failures("quoting"))
    assert line.startswith("RuntimeError: Error raised in subprocess: ")
    assert line.endswith("KeyError: 1") and "\n" not in line


def test_no_message_and_no_traceback(failures: Any) -> None:
    assert root_cause(failures("bare")) == "NotImplementedError"
    assert root_cause("The actor died unexpectedly.\n\tpid: 7\nWorker exit: OOM\n") == (
        "Worker exit: OOM"
    )
