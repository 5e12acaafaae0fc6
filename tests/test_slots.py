"""The slot table and the lockstep rule (I2), without torch or grpc: two tables stand for two
ranks, and `reduce_max` stands for the all-reduce."""

import threading
import time

import pytest

from gpu_worker.control.slots import NoFreeSlot, SlotBusy, SlotTable, UnknownRequest, request_key


def reduce_max(*vectors):
    return [max(vals) for vals in zip(*vectors, strict=True)]


def step(*tables):
    reduced = reduce_max(*(t.local_vector() for t in tables))
    return [t.apply(reduced) for t in tables]


@pytest.fixture
def group():
    return (SlotTable(4, is_rank0=True, admit_timeout_s=5),
            SlotTable(4, is_rank0=False, admit_timeout_s=5, busy_wait_s=0.05))


def test_request_key_is_stable_and_non_negative():
    assert request_key("abc") == request_key("abc")
    assert request_key("abc") != request_key("abd")
    assert 0 <= request_key("x") < 2 ** 62


def test_slot_starts_only_when_every_rank_holds_the_admit(group):
    r0, r1 = group
    entry = r0.allocate("a", payload="A")
    d0, d1 = step(r0, r1)
    assert d0.starts == [] and d1.starts == []
    r1.register(entry.slot, "a", payload="A1")
    d0, d1 = step(r0, r1)
    assert [e.request_id for e in d0.starts] == ["a"]
    assert [e.request_id for e in d1.starts] == ["a"]
    assert d1.starts[0].payload == "A1"  # each rank keeps its own payload (own matcher: I1)


def test_draining_group_starts_no_pending_admit_but_still_releases(group):
    r0, r1 = group
    run = r0.allocate("run", payload="R")
    r1.register(run.slot, "run", payload="R1")
    step(r0, r1)
    late = r0.allocate("late", payload="L")
    r1.register(late.slot, "late", payload="L1")
    r1.request_release(run.slot, "run")
    reduced = reduce_max(r0.local_vector(), r1.local_vector())
    for t in (r0, r1):
        d = t.apply(reduced, admit=False)
        assert d.starts == [] and [e.request_id for e in d.releases] == ["run"]
    assert [s for s, _ in r0.snapshot()][:2] == ["free", "pending"]


def test_mismatched_request_ids_never_start(group):
    r0, r1 = group
    entry = r0.allocate("a", payload=None)
    r1.register(entry.slot, "stale", payload=None)
    for _ in range(3):
        assert all(d.starts == [] for d in step(r0, r1))
    r1.register(entry.slot, "a", payload=None)  # the newer Admit replaces the stale one
    assert [e.request_id for e in step(r0, r1)[1].starts] == ["a"]


def test_release_from_any_rank_takes_effect_on_both_at_the_same_step(group):
    r0, r1 = group
    e = r0.allocate("a", None)
    r1.register(e.slot, "a", None)
    step(r0, r1)
    assert r1.request_release(e.slot, "a") is True
    d0, d1 = step(r0, r1)
    assert [x.request_id for x in d0.releases] == ["a"] == [x.request_id for x in d1.releases]
    assert r0.in_use() == 0 and r1.in_use() == 0


def test_stale_release_never_frees_the_next_tenant(group):
    r0, r1 = group
    e = r0.allocate("old", None)
    r1.register(e.slot, "old", None)
    step(r0, r1)
    r0.request_release(e.slot, "old")
    step(r0, r1)
    e2 = r0.allocate("new", None)
    assert e2.slot == e.slot
    r1.register(e2.slot, "new", None)
    step(r0, r1)
    with pytest.raises(UnknownRequest):
        r1.request_release(e.slot, "old")  # late Release of the previous tenant
    assert all(d.releases == [] for d in step(r0, r1))
    assert r0.snapshot()[e.slot][0] == "running"


def test_double_release_is_unknown(group):
    r0, r1 = group
    e = r0.allocate("a", None)
    r1.register(e.slot, "a", None)
    step(r0, r1)
    r0.request_release(e.slot, "a")
    step(r0, r1)
    with pytest.raises(UnknownRequest):
        r0.request_release(e.slot, "a")


def test_late_admit_of_a_released_request_is_refused(group):
    r0, r1 = group
    e = r0.allocate("a", None)
    with pytest.raises(UnknownRequest):
        r1.request_release(e.slot, "a")  # Release reaches rank 1 before its Admit
    with pytest.raises(UnknownRequest):
        r1.register(e.slot, "a", None)


def test_pending_release_drops_entry_and_runs_on_drop(group):
    r0, _ = group
    dropped = []
    e = r0.allocate("a", None, on_drop=lambda entry, why: dropped.append(why))
    assert r0.request_release(e.slot, "a") is False
    assert dropped == ["released"] and r0.in_use() == 0


def test_allocation_expires_when_another_rank_never_gets_the_admit():
    from prometheus_client import CollectorRegistry

    from gpu_worker.metrics import WorkerMetrics

    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    r0 = SlotTable(2, is_rank0=True, admit_timeout_s=0.05, on_expire=metrics.admit_expired.inc)
    dropped = []
    r0.allocate("a", None, on_drop=lambda e, why: dropped.append(why))
    time.sleep(0.1)
    r0.local_vector()
    r0.abort_step()
    assert dropped == ["expired"] and r0.in_use() == 0
    assert registry.get_sample_value("gramserve_worker_admit_expired_total") == 1


def test_full_table_raises_no_free_slot(group):
    r0, _ = group
    for i in range(4):
        r0.allocate(f"r{i}", None)
    with pytest.raises(NoFreeSlot):
        r0.allocate("one-too-many", None)


def test_admit_to_a_running_slot_is_busy(group):
    r0, r1 = group
    e = r0.allocate("a", None)
    r1.register(e.slot, "a", None)
    step(r0, r1)
    with pytest.raises(SlotBusy):
        r1.register(e.slot, "b", None)


def test_admit_waits_for_a_release_one_step_away():
    r0 = SlotTable(1, is_rank0=True, admit_timeout_s=5)
    r1 = SlotTable(1, is_rank0=False, admit_timeout_s=5, busy_wait_s=2.0)
    r0.allocate("a", None)
    r1.register(0, "a", None)
    step(r0, r1)
    r0.request_release(0, "a")
    out = {}

    def admit_b():
        out["entry"] = r1.register(0, "b", None)

    t = threading.Thread(target=admit_b)
    red = reduce_max(r0.local_vector(), r1.local_vector())
    r0.apply(red)
    t.start()
    time.sleep(0.05)
    r1.apply(red)  # rank 1 applies the release a little later than rank 0
    t.join(2)
    assert out["entry"].request_id == "b"


def test_released_slot_is_indistinguishable_from_fresh():
    r0 = SlotTable(2, is_rank0=True, admit_timeout_s=5)
    fresh = r0.local_vector()
    r0.abort_step()
    e = r0.allocate("a", None)
    step(r0)
    r0.request_release(e.slot, "a")
    step(r0)
    assert r0.local_vector() == fresh
