"""Routing LoRA adapters: each adapter's blocks apart in the index, its load priced where it
is not resident, a hot adapter spread when its holder is loaded, a cold one kept from slots
held by running adapters, the slot a waiting request needs not fed, a slot in demand not
taken, and the two baselines' rules."""

from __future__ import annotations

import msgspec

from kvroute.events import BlockHasher, BlockStored, EventBatch
from kvroute.events.load import REFERENCE_COEFFICIENTS, LoadReport
from kvroute.router.routing.index import PrefixIndex
from kvroute.router.routing.load import LoadTracker
from kvroute.router.routing.policies import make_policy
from kvroute.router.routing.policy import KVPolicy, RequestView

BS = 16
HASHER = BlockHasher(block_size=BS)
R = ["replica-0", "replica-1"]
C = msgspec.structs.replace(REFERENCE_COEFFICIENTS, lora_load_s=0.004, lora_read_s=0.05)


def tokens(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def view(rid: str, toks: list[int], lora: str | None) -> RequestView:
    hashes = HASHER.hash_blocks(toks, lora_name=lora)
    return RequestView(rid, len(toks), hashes, BS, toks, max_tokens=128, lora_name=lora)


def hold(index: PrefixIndex, replica: str, toks: list[int], lora: str | None) -> None:
    hashes = HASHER.hash_blocks(toks, lora_name=lora)
    ev = BlockStored(hashes, None, toks[: len(hashes) * BS], BS, None, "GPU", lora)
    index.apply(replica, EventBatch(0.0, [ev]))


def report(queued: int = 0, **lora: object) -> LoadReport:
    fields: dict[str, object] = {"lora_slots": 4, "lora_free_slots": 4, **lora}
    return LoadReport(
        num_waiting=0, num_running=0, num_decoding=0, queued_prefill_tokens=queued,
        decode_context_tokens=0, free_blocks=10_000, total_blocks=20_000, **fields,  # type: ignore[arg-type]
    )  # fmt: skip


def fleet(name: str = "kv", **reports: LoadReport) -> KVPolicy:
    load = LoadTracker()
    for r in R:
        load.register(r, C, 20_000)
        load.report(r, reports.get(r.replace("-", "_"), report()), 0.0)
    return make_policy(name, index=PrefixIndex(), load=load, seed=3)  # type: ignore[return-value]


def test_blocks_of_two_adapters_never_match_each_other():
    index = PrefixIndex()
    prompt = tokens(160)
    hold(index, "replica-0", prompt, "lora-a")
    hold(index, "replica-1", prompt, None)
    a = HASHER.hash_blocks(prompt, lora_name="lora-a")
    b = HASHER.hash_blocks(prompt, lora_name="lora-b")
    base = HASHER.hash_blocks(prompt)
    assert index.match(a, 0.0) == {"replica-0": 10}
    assert index.match(b, 0.0) == {}  # the same tokens under another adapter: nothing
    assert index.match(base, 0.0) == {"replica-1": 10}  # the base model's are its own
    assert not set(a) & set(b) and not set(a) & set(base)


def test_a_non_resident_adapter_is_priced_above_a_resident_one():
    policy = fleet(
        replica_0=report(lora_resident=("a",), lora_free_slots=3, lora_host=("a",)),
        replica_1=report(),
    )
    req = view("q", tokens(200), "a")
    parts = policy.breakdown(req, R, 0.1)
    assert parts["replica-0"].adapter == 0.0
    assert parts["replica-1"].adapter == C.lora_load_s + C.lora_read_s  # read, then copied
    assert policy.route(req, R, 0.1).replica == "replica-0"
    in_host = fleet(replica_1=report(lora_host=("a",)))  # only a copy away there
    assert in_host.breakdown(req, R, 0.1)["replica-1"].adapter == C.lora_load_s
    blind = fleet("kv:lora_blind", replica_0=report(lora_resident=("a",), lora_free_slots=3))
    costs = blind.costs(req, R, 0.1)
    assert costs["replica-0"] == costs["replica-1"]  # blind: the adapter is not priced


def test_a_placed_adapter_counts_as_resident_until_the_next_report():
    policy = fleet()
    first = policy.route(view("q1", tokens(200), "a"), R, 0.1)
    other = next(r for r in R if r != first.replica)
    parts = policy.breakdown(view("q2", tokens(200, 5000), "a"), R, 0.2)
    assert parts[first.replica].adapter == 0.0 and parts[other].adapter > 0.0


def test_a_hot_adapter_spreads_when_its_holder_is_loaded():
    held = {"lora_resident": ("hot",), "lora_free_slots": 3, "lora_running": ("hot",)}
    prompt = tokens(2048)
    light = fleet(replica_0=report(queued=1000, **held))
    hold(light.index, "replica-0", prompt, "hot")
    req = view("q", prompt + tokens(100, 9000), "hot")
    assert light.route(req, R, 0.1).replica == "replica-0"  # prefix and adapter there
    busy = fleet(replica_0=report(queued=200_000, **held))
    hold(busy.index, "replica-0", prompt, "hot")
    d = busy.route(req, R, 0.1)
    assert d.replica == "replica-1"  # its holder's queue outweighs the prefill and the load


def test_a_cold_adapter_is_kept_from_slots_held_by_running_adapters():
    """replica-0 is idler, but its four slots are held by running adapters: the request
    would wait for one of them to drain there. replica-1 has a free slot."""
    full = report(lora_resident=("w", "x", "y", "z"), lora_free_slots=0,
                  lora_running=("w", "x", "y", "z"))  # fmt: skip
    policy = fleet(replica_0=full, replica_1=report(queued=5_000))
    req = view("q", tokens(300), "cold")
    parts = policy.breakdown(req, R, 0.1)
    assert parts["replica-0"].adapter > parts["replica-0"].decode / 2  # a drain's wait
    assert policy.route(req, R, 0.1).replica == "replica-1"
    idle = report(lora_resident=("w", "x", "y", "z"), lora_free_slots=0)  # none running
    got = fleet(replica_0=idle).breakdown(req, R, 0.1)["replica-0"].adapter
    assert got == C.lora_load_s + C.lora_read_s  # a load, no wait (nor demand to evict)


def test_feeding_the_next_slot_to_free_is_priced_at_the_wait_it_adds():
    """replica-0's four slots are held by running adapters and this router sent a request
    of "cold" there, which waits for the first to drain. "w" (one request in flight) will
    likely drain first: a new request of it pays the delay it would add, and goes to
    replica-1 where "w" is resident too. "x" (twelve in flight) holds its slot long
    anyway: feeding it delays the waiting request little, and replica-0 keeps it."""
    running = ("w", "x", "y", "z")
    full = report(lora_resident=running, lora_free_slots=0, lora_running=running)
    other = report(queued=800, lora_resident=("w", "x"), lora_free_slots=2)
    policy = fleet(replica_0=full, replica_1=other)
    routed = {"w": 1, "x": 12, "y": 3, "z": 3}
    for a, n in routed.items():
        for i in range(n):
            policy.adapters.routed(f"{a}{i}", "replica-0", a, 0.0)
    before = policy.breakdown(view("pw", tokens(300), "w"), R, 0.1)
    assert before["replica-0"].adapter == 0.0  # no request waits for a slot yet
    assert min(before, key=lambda r: before[r].total) == "replica-0"
    policy.adapters.routed("c0", "replica-0", "cold", 0.1)  # now one does
    w = policy.breakdown(view("qw", tokens(300), "w"), R, 0.2)
    x = policy.breakdown(view("qx", tokens(300), "x"), R, 0.2)
    decode = w["replica-0"].decode
    # w drains at decode / 2 (one request), the next holder at decode * 3/4 (three): a new
    # request of w moves the first free slot from decode / 2 to decode * 3/4
    assert abs(w["replica-0"].adapter - decode / 4) < 1e-9 * decode
    assert x["replica-0"].adapter == 0.0  # x drains after y and z: feeding it moves nothing
    assert policy.route(view("qw", tokens(300), "w"), R, 0.2).replica == "replica-1"
    assert policy.route(view("qx", tokens(300), "x"), R, 0.2).replica == "replica-0"


def test_a_slot_in_demand_is_not_taken_for_a_passing_adapter():
    """Both replicas' slots are full of idle adapters; replica-0's saw requests a moment
    ago, replica-1's none in a long while: a newcomer evicts on replica-1."""
    policy = fleet(
        replica_0=report(lora_resident=("a", "b", "c", "d"), lora_free_slots=0),
        replica_1=report(lora_resident=("e", "f", "g", "h"), lora_free_slots=0),
    )
    for i, a in enumerate("abcd" * 30):  # recent demand on replica-0, all finished
        policy.adapters.routed(f"old{i}", "replica-0", a, 0.0)
        policy.adapters.finished(f"old{i}")
    req = view("q", tokens(300), "new")
    parts = policy.breakdown(req, R, 0.1)
    assert parts["replica-0"].adapter > parts["replica-1"].adapter >= C.lora_load_s
    assert policy.route(req, R, 0.1).replica == "replica-1"


def test_lora_affinity_prefers_resident_then_a_free_slot_then_load():
    load = LoadTracker()
    reps = ["r0", "r1", "r2"]
    full = report(lora_resident=("w", "x", "y", "z"), lora_free_slots=0)
    for r, rep in zip(reps, [full, report(), report(lora_resident=("a",), lora_free_slots=3)],
                      strict=True):  # fmt: skip
        load.register(r, C, 20_000)
        load.report(r, rep, 0.0)
    policy = make_policy("lora_affinity", load=load, seed=1)
    assert policy.route(view("q1", tokens(50), "a"), reps, 0.1).replica == "r2"
    assert policy.route(view("q2", tokens(50), "b"), reps, 0.1).replica == "r1"  # free slot
    policy.on_finished("q2", 0.2)  # r1 and r2 have free slots: one request in flight at r2
    assert policy.route(view("q3", tokens(50), "c"), reps, 0.3).replica == "r1"
