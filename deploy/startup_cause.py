"""Why a fleet did not start, on one line: the root of the traceback Ray hands back.

Why: a replica actor whose creation fails reaches the driver as Ray's error text, a chain
of tracebacks (Ray's wrapper, the engine's, the loader's) that can run to hundreds of lines;
``kvroute serve`` prints the one exception that caused the rest and exits, so the cause is
the last line a user sees, not buried in a scroll.
"""

from __future__ import annotations

import re


class StartupError(RuntimeError):
    """The fleet could not start for a reason one line can say."""


_CAUSED = "The above exception was the direct cause of the following exception:"
_CHAIN = re.compile(
    rf"^({re.escape(_CAUSED)}|During handling of the above exception, another exception "
    r"occurred:)$",
    re.M,
)
_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(: |:?$)")  # "pkg.mod.SomeError: message"
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its "ray::Actor.method()" headers
_PYDANTIC_LINK = "For further information visit "
_PYDANTIC_INPUT = re.compile(r"\s*\[type=\w+, input_value=.*, input_type=[\w.]+\]$")
CAUSE_CHARS = 400  # a root cause's line is cut here


def root_cause(text: str) -> str:
    """The root exception of a Python traceback's text (Ray's error for a task or an actor
    whose creation failed carries only that text), on one line: ``Type: message``.

    The root is the raised exception's innermost explicit cause (``raise ... from``; an
    exception merely being handled when it was raised is not its cause). Its message's
    lines are joined; pydantic's link and input echo are dropped. Text with no exception
    in it gives its last line."""
    parts = _CHAIN.split(_COLOUR.sub("", text))  # blocks, a chained one after its separator
    i = len(parts) - 1
    while i >= 2 and parts[i - 1] == _CAUSED:
        i -= 2
    lines = parts[i].strip("\n").splitlines()
    # The exception's line comes after the frames, unindented (a message may quote a
    # traceback of its own: vLLM's "Error raised in subprocess: ..."). Ray gives a cause
    # no frames: there it is the first line that reads as one, after Ray's header.
    frame = next((n for n, line in enumerate(lines) if line.startswith("  File ")), None)
    if frame is not None:
        start = next((n for n in range(frame, len(lines)) if lines[n][:1].strip()), None)
    else:
        start = next((n for n, line in enumerate(lines) if _EXCEPTION_LINE.match(line)), None)
    if start is None:
        return next((line.strip() for line in reversed(lines) if line.strip()), text.strip())
    kind, _, first = lines[start].partition(": ")
    message = first.strip()
    for more in lines[start + 1 :]:
        more = _PYDANTIC_INPUT.sub("", more.strip())
        if more and not more.startswith(_PYDANTIC_LINK):
            message += more if not message else (" " if message.endswith(":") else "; ") + more
    line = kind.rstrip(":").rsplit(".", 1)[-1] + (f": {message}" if message else "")
    return line if len(line) <= CAUSE_CHARS else line[: CAUSE_CHARS - 3] + "..."
