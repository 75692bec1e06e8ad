"""How many runs a request's choices make, and whether it may make them.

Why apart from :mod:`.intake`: a request with several choices (a batch of prompts, ``n``
> 1, ``best_of``'s candidates) runs as several requests, and the count is read by intake
(to admit and check them), :mod:`.respond` (to answer them) and the app (to echo them):
one definition for all three.
"""

from __future__ import annotations

from typing import Any

from ...fleet.admission import Admission
from ...fleet.tenants import Tenant
from ..errors import APIError
from ..openai_api import MAX_CHOICES


def check_choices(body: Any, num_prompts: int, tenant: Tenant, admission: Admission) -> None:
    """Several choices (a batch, ``n`` > 1, ``best_of``'s candidates): at most
    ``MAX_CHOICES`` of them, and no more than the tenant may ever run at once (a 429
    would tell its client to retry what can never be admitted). ``best_of`` is at
    least ``n`` and, above it, not streamed: the best are known only at the end."""
    best_of = body.best_of
    if best_of is not None and best_of < (body.n or 1):
        raise APIError(400, "`best_of` must be at least `n`.", "invalid_request_error", "best_of")
    if ranked(body) and body.stream:
        raise APIError(
            400,
            "`best_of` above `n` cannot be streamed: the best are known only once every "
            "candidate has finished.",
            "invalid_request_error",
            "best_of",
        )
    n = runs_per_prompt(body)
    param = "best_of" if ranked(body) else "n" if n > 1 else "prompt"
    if num_prompts * n > MAX_CHOICES:
        raise APIError(
            400,
            f"{num_prompts} prompt(s) x n={n} is more than {MAX_CHOICES} choices.",
            "invalid_request_error",
            param,
        )
    cap = admission.concurrency_cap(tenant) if num_prompts * n > 1 else None
    if cap is not None and num_prompts * n > cap:
        raise APIError(
            400,
            f"{num_prompts} prompt(s) x n={n} choices run as {num_prompts * n} requests; "
            f"this tenant may run at most {cap} at once.",
            "invalid_request_error",
            param,
        )


def ranked(body: Any) -> bool:
    """Whether ``body`` asks for ``best_of`` candidates to pick its ``n`` choices from."""
    return (body.best_of or 1) > (body.n or 1)


def runs_per_prompt(body: Any) -> int:
    """Runs per prompt: ``best_of`` candidates, else ``n`` choices."""
    return max(body.n or 1, body.best_of or 1)
