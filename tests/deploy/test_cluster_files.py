"""The cluster files: what Ray's own validator and KubeRay's required fields accept, and
command lines the ``kvroute`` parser accepts.

Why these checks: a cluster file is read only when someone runs ``ray up`` or ``kubectl
apply`` on a real cloud, minutes and dollars later. The installed Ray validates the launcher
file exactly as ``ray up`` would (defaults filled in, then the JSON schema); for KubeRay,
whose CRD schema is not installed here, the fields its operator requires are checked by hand.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvroute.deploy.cli import build_parser
from kvroute.router.fleet.tenants import METRICS_KEY_ENV, load_tenants

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def kvroute_args(command: str) -> list[str]:
    """The arguments of the ``kvroute`` call inside a shell command line."""
    words = shlex.split(command.replace(";", " ; "))
    start = words.index("kvroute") + 1
    end = next((i for i in range(start, len(words)) if words[i] in (">", "&", ";", "2>&1")),
               len(words))  # fmt: skip
    return words[start:end]


def assert_parses(args: list[str]) -> None:
    """The real parser takes every flag (argparse exits on an unknown one)."""
    parsed = build_parser().parse_args(args)
    assert parsed.command == args[0]


# -- Ray cluster launcher -------------------------------------------------------------------
@pytest.fixture(scope="module")
def launcher() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())


def test_ray_validates_the_launcher_file(launcher: dict[str, Any]) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(launcher)
    assert validate_config(config) is None  # what `ray up` runs first; raises if invalid
    assert config["head_node_type"] in config["available_node_types"]


def test_launcher_file_gpu_workers_cpu_head_and_the_start_line(launcher: dict[str, Any]) -> None:
    types = launcher["available_node_types"]
    head = types[launcher["head_node_type"]]
    assert not head["resources"].get("GPU") and head["node_config"]["InstanceType"][0] in "mcr"
    workers = [t for name, t in types.items() if name != launcher["head_node_type"]]
    assert workers and all(t["node_config"]["InstanceType"][0] in "gp" for t in workers)
    assert all(0 < t["min_workers"] <= t["max_workers"] <= launcher["max_workers"] for t in workers)
    setup = " ".join(launcher["setup_commands"])
    assert 'pip install -e "$HOME/kvroute[structured]"' in setup and "torch" in setup
    assert launcher["file_mounts"]["~/kvroute"] == "."
    starts = [c for c in launcher["head_start_ray_commands"] if "kvroute serve" in c]
    assert len(starts) == 1
    args = kvroute_args(starts[0])
    assert_parses(args)
    assert args[args.index("--address") + 1] == "auto"
    ports = launcher["provider"]["security_group"]["IpPermissions"]
    assert any(p["FromPort"] == int(args[args.index("--port") + 1]) for p in ports)


# -- KubeRay --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def manifests() -> dict[str, dict[str, Any]]:
    docs = [d for f in sorted((DEPLOY / "kuberay").glob("*.yaml"))
            for d in yaml.safe_load_all(f.read_text()) if d]  # fmt: skip
    return {d["kind"]: d for d in docs}


def containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    return template["spec"]["containers"]


def test_raycluster_has_what_kuberay_requires(manifests: dict[str, dict[str, Any]]) -> None:
    rc = manifests["RayCluster"]
    assert rc["apiVersion"] == "ray.io/v1" and rc["metadata"]["name"]
    import ray

    assert rc["spec"]["rayVersion"] == ray.__version__  # head, workers and laptop agree
    head = rc["spec"]["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    groups = rc["spec"]["workerGroupSpecs"]
    assert groups
    for g in groups:
        assert g["groupName"] and isinstance(g["rayStartParams"], dict)
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
    for template in [head["template"], *(g["template"] for g in groups)]:
        for c in containers(template):
            assert c["name"] and c["image"]
            res = c["resources"]
            assert set(res["requests"]) == set(res["limits"]), c["name"]  # requests = limits
            assert {"cpu", "memory"} <= set(res["limits"])
    head_gpus = [
        c["resources"]["limits"].get("nvidia.com/gpu") for c in containers(head["template"])
    ]
    assert not any(head_gpus) and head["rayStartParams"].get("num-gpus") == "0"
    for g in groups:
        assert all(
            c["resources"]["limits"].get("nvidia.com/gpu") for c in containers(g["template"])
        )


def test_front_door_command_service_secret_and_scrape(
    manifests: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    head = manifests["RayCluster"]["spec"]["headGroupSpec"]["template"]
    door = next(c for c in containers(head) if any("kvroute serve" in a for a in c.get("args", [])))
    args = kvroute_args(" ".join(door["args"]))
    assert_parses(args)
    port = int(args[args.index("--port") + 1])
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert any(p["containerPort"] == port for p in door["ports"])
    svc = manifests["Service"]
    labels = head["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert any(p["targetPort"] == port for p in svc["spec"]["ports"])
    secret = manifests["Secret"]
    refs = [e["valueFrom"]["secretKeyRef"] for e in door["env"] if "valueFrom" in e]
    assert refs and all(r["name"] == secret["metadata"]["name"] for r in refs)
    assert all(r["key"] in secret["stringData"] for r in refs)
    keys_file = args[args.index("--tenants") + 1]
    mounts = {m["name"]: m["mountPath"] for m in door["volumeMounts"]}
    vols = {v["name"]: v for v in head["spec"]["volumes"]}
    tenants = next(n for n, p in mounts.items() if keys_file.startswith(p + "/"))
    items = vols[tenants]["secret"]["items"]
    item = next(i for i in items if keys_file.endswith("/" + i["path"]))
    path = tmp_path / "tenants.toml"  # the Secret's tenants file is one kvroute accepts
    path.write_text(secret["stringData"][item["key"]])
    assert load_tenants(path).tenants
    ann = head["metadata"]["annotations"]
    assert ann["prometheus.io/port"] == str(port) and ann["prometheus.io/path"] == "/metrics"
    pm = manifests["PodMonitor"]["spec"]
    assert pm["selector"]["matchLabels"].items() <= labels.items()
    assert pm["podMetricsEndpoints"][0]["path"] == "/metrics"
    # With a tenants file /metrics needs an admin or the metrics key: the PodMonitor sends
    # the Secret's key the front door reads as $KVROUTE_METRICS_KEY.
    read = next(e for e in door["env"] if e["name"] == METRICS_KEY_ENV)["valueFrom"]
    auth = pm["podMetricsEndpoints"][0]["authorization"]
    assert auth["type"] == "Bearer" and auth["credentials"] == read["secretKeyRef"]


def test_the_start_commands_run_with_help() -> None:
    for sub in ("serve", "router"):
        out = subprocess.run([sys.executable, "-m", "kvroute.deploy.cli", sub, "--help"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert out.returncode == 0 and "--address" in out.stdout, out.stderr
