"""Names an operator or an admin chooses -- tenant ids, LoRA adapter names -- that kvroute
repeats elsewhere: as ``/metrics`` label values, in logs, in error messages.

Why control characters are refused where a name is made (a tenants file, a key file,
``--lora-modules``, ``/v1/load_lora_adapter``): the Prometheus text format escapes only
backslash, double quote and newline in a label value, so a NUL or an ESC would go out raw
(``/metrics`` still replaces any that reach it: :func:`kvroute.router.api.metrics.render_metrics`);
in a log line or a terminal they hide or forge what follows; no real name needs one.
"""

from __future__ import annotations

import re

# C0 controls, DEL and C1 controls.
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def control_char(name: str) -> str | None:
    """The first control character in ``name`` (as ``repr`` writes it), or None."""
    found = CONTROL_CHARS.search(name)
    return None if found is None else repr(found.group())


def check_name(name: str, what: str) -> None:
    """Raises ValueError naming ``what`` (e.g. ``tenant id``) when ``name`` holds a control
    character."""
    bad = control_char(name)
    if bad is not None:
        raise ValueError(f"{what} {name[:100]!r} holds a control character ({bad})")
