"""What a Ray cluster holds (deploy/capacity.py), with numbers: a replica's needs from its
Ray options, how many fit on nodes, an autoscaler's limits, and the refusal's wording.
The live refusal on a real Ray is tests/deploy/test_scale.py's."""

from __future__ import annotations

import math

from kvroute.deploy.capacity import (
    Room,
    bootstrap_limits,
    fits,
    fits_on_nodes,
    max_from_groups,
    need_of,
)


def test_a_replica_needs_what_its_ray_options_reserve() -> None:
    assert need_of({"num_cpus": 1, "num_gpus": 0}) == {"CPU": 1.0}
    assert need_of({}) == {"CPU": 1.0}  # start_replica's default
    assert need_of({"num_cpus": 0}) == {}  # a sim: replica reserves nothing
    opts = {"num_cpus": 2, "num_gpus": 0.5, "memory": 4e9, "resources": {"kvroute_replica": 1}}
    assert need_of(opts) == {"CPU": 2, "GPU": 0.5, "memory": 4e9, "kvroute_replica": 1}
    assert need_of({"num_cpus": 1, "accelerator_type": "L4"})["accelerator_type:L4"] > 0


def test_replicas_fit_node_by_node() -> None:
    need = {"CPU": 1.0, "GPU": 1.0}
    assert fits({"CPU": 8, "GPU": 2}, need) == 2
    assert fits({"CPU": 8}, need) == 0
    assert fits({"CPU": 8}, {}) is None  # needs nothing: no limit
    # 1.5 GPUs free on each of two nodes: one replica of 1 GPU each, not three.
    assert fits_on_nodes([{"CPU": 4, "GPU": 1.5}, {"CPU": 4, "GPU": 1.5}], need) == 2
    assert fits_on_nodes([{"CPU": 0.3}] * 10, {"CPU": 0.1}) == 30  # no float shortfall
    assert fits_on_nodes([], need) == 0


def test_an_autoscalers_limits_from_its_node_groups() -> None:
    groups = [({"CPU": 8}, 1), ({"CPU": 8, "GPU": 1}, 8)]
    assert max_from_groups(groups) == {"CPU": 72, "GPU": 8}
    assert max_from_groups(groups, {"GPU": 4}) == {"CPU": 72, "GPU": 4}
    assert max_from_groups([({"GPU": 1}, -1)]) == {"GPU": math.inf}
    launcher = {  # deploy/ray-cluster.yaml's shape, resources as the launcher fills them
        "max_workers": 8,
        "head_node_type": "head.cpu",
        "available_node_types": {
            "head.cpu": {"resources": {"CPU": 8}},
            "worker.gpu": {"min_workers": 1, "max_workers": 20, "resources": {"CPU": 8, "GPU": 1}},
        },
    }
    assert bootstrap_limits(launcher) == {"CPU": 72, "GPU": 8}


def test_the_refusal_says_how_many_fit_and_how_to_wait() -> None:
    room = Room({"CPU": 1.0}, now=1, free={"CPU": 1.0})
    assert room.refusal(1) is None and room.grows_to(2) == 3
    why = room.refusal(998) or ""
    assert why.startswith(
        "998 more replica(s) need CPU 1 each; the cluster has room for 1 more (CPU 1 free)"
    )
    assert "--wait-for-resources" in why
    # An autoscaler's limit counts; one whose limit is not known refuses nothing.
    grows = Room({"GPU": 1.0}, now=0, most=6, autoscaler=True)
    assert grows.refusal(6) is None and "autoscaler can make room for 6" in (grows.refusal(7) or "")
    assert Room({"GPU": 1.0}, now=0, autoscaler=True).refusal(1000) is None
    assert Room({}, now=None).refusal(1000) is None  # needs nothing


def test_no_limit_is_no_overflow() -> None:
    assert fits({"GPU": math.inf}, {"GPU": 1.0}) > 10**9
