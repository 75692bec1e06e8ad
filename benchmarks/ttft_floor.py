"""The lowest TTFT p90 ratio (flooded over idle) any scheduler can give a probe on a busy
cost-model replica: what issue 53's fairness and priority goals are read against.

Why there is a floor: an engine step is not cut short. A probe that arrives while the
flood's step runs waits for it to end, and no step of a busy replica is shorter than one
request's decode alone (the model's weights read once: a step's memory floor). Whatever
the steps' lengths, at least 10% of probes arrive with more than 0.9 of that shortest step
still to run, on top of their own step, which is no shorter than when idle. So, about::

    flooded p90 >= idle p90 + 0.9 * busy_step * time_scale

with ``busy_step`` (one decode at the flood's prompt length) from
:class:`~kvroute.replica.model.cost_model.CostModel` (the same roofline the replicas
sleep). Imported by ``bench_fair_share.py`` and ``bench_priority.py``
with this folder on ``sys.path``.
"""

from __future__ import annotations

from kvroute.replica.model.cost_model import H100_8B, CostModel, Profile


def busy_step_s(decodes: int, context: int, profile: Profile = H100_8B) -> float:
    """Modelled seconds of a step of ``decodes`` requests decoding at ``context`` tokens
    each, and nothing else: the shortest step of a replica the flood keeps busy."""
    return CostModel(profile).step_time(decodes, decodes * context, decodes * (context + 1))


def floor_ratio(idle_p90_s: float, context: int, time_scale: float) -> float:
    """The floor of flooded p90 / idle p90, from a measured idle p90 (wall seconds, so the
    fixed costs around the engine count as they do in the measurement)."""
    wait = 0.9 * busy_step_s(1, context) * time_scale
    return (idle_p90_s + wait) / idle_p90_s
