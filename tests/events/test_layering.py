"""The contract (``kvroute.events``) stands apart from its transport (``kvroute.events.transport``).

What it proves: a fresh interpreter that imports every contract module loads neither ZeroMQ
nor any module of the transport, starts no thread, and leaves ``sys.modules`` without the
None entries that hide torch companions (importing the contract has no side effect; the
entry points hide them, tests/events/test_torch_wheels.py); the transport, imported after,
brings ZeroMQ; and no contract module names the transport in its imports.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import kvroute.events

EVENTS = Path(kvroute.events.__file__).parent
# Every module of the contract (events/__init__.py lists them). Not here: the transport and
# the process setup (torch_wheels, neither).
CONTRACT = [
    "blockset",
    "bounds",
    "dataplane_wire",
    "framing",
    "hashing",
    "load",
    "replica_api",
    "kv_transfer",
    "translate",
    "wire",
]

PROBE = """
import json, sys, threading
before = {k for k, v in sys.modules.items() if v is None}
import kvroute.events
for name in sys.argv[1:]:
    __import__("kvroute.events." + name)
after = {k for k, v in sys.modules.items() if v is None}
contract = {
    "zmq": "zmq" in sys.modules,
    "transport": sorted(m for m in sys.modules if m.startswith("kvroute.events.transport")),
    "threads": threading.active_count(),
    "hidden": sorted(after - before),
}
import kvroute.events.transport
print(json.dumps({"contract": contract, "transport_zmq": "zmq" in sys.modules}))
"""


def test_the_package_says_which_modules_are_the_contract() -> None:
    doc = kvroute.events.__doc__ or ""
    for name in [*CONTRACT, "transport", "torch_wheels"]:
        assert f":mod:`.{name}`" in doc, name
    modules = {p.stem for p in EVENTS.glob("*.py")} - {"__init__"}
    assert modules == {*CONTRACT, "torch_wheels"}  # the transport is not among them


def test_importing_the_contract_loads_no_transport_and_changes_nothing() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *CONTRACT], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["contract"] == {"zmq": False, "transport": [], "threads": 1, "hidden": []}
    assert seen["transport_zmq"]  # the probe itself can see ZeroMQ arrive


def test_no_contract_module_imports_the_transport() -> None:
    for name in ["__init__", *CONTRACT]:
        tree = ast.parse((EVENTS / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = "." * node.level + (node.module or "")
                names = [a.name for a in node.names]
                assert "transport" not in module and "transport" not in names, (name, module)
                assert node.module != "zmq", name
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith(("zmq", "kvroute.events.transport")), name
