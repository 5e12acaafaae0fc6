"""Each rank's gRPC front runs in a process of its own (gpu_worker/control/front.py) and relays
to the engine process over a socket pair. Real processes: a TP=1 group of 48 slots driven by
several gateway sessions at once, whose rows the front must hand back to the session that
admitted each request (every session numbers its requests from 1, so tags collide across
sessions); a session that vanishes mid-stream; and either process of a rank killed."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from worker_procs import GroupClient, metric, start_grammar_service, start_group

from grammar_service.default_model import ensure_default_model
from grammar_service.vocab import load_vocab
from protos import common_pb2, worker_pb2

SLOTS = 48


def _children(pid: int) -> dict[int, list[str]]:
    """Direct children of `pid` with their command lines (from /proc)."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().decode(
                    errors="replace").split("\0")
        except (OSError, ValueError, IndexError):
            continue
    return out


def _rank_and_front(group_pid: int) -> tuple[int, int]:
    """(rank 0's engine process, its front process) under a `gpu_worker.launch`."""
    rank = next(p for p, argv in _children(group_pid).items() if "gpu_worker" in argv)
    front = next(p for p, argv in _children(rank).items() if "gpu_worker.control.front" in argv)
    return rank, front


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        if stat.rsplit(")", 1)[1].split()[0] == "Z":  # exited, not yet reaped
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    root = tmp_path_factory.mktemp("front")
    model_dir = ensure_default_model(root / "models")
    procs = []
    try:
        gs, gaddr = start_grammar_service(model_dir, root)
        procs.append(gs)
        group, addrs, urls = start_group(model_dir, gaddr, root, tp=1, slots=SLOTS)
        procs.append(group)
        yield {"model_dir": model_dir, "grammar": gaddr, "addrs": addrs, "urls": urls,
               "vocab": load_vocab(model_dir), "root": root, "group": group}
    finally:
        for p in reversed(procs):
            p.stop()


def _wait_idle(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(url, "gramserve_worker_slots_in_use") != 0:
        assert time.monotonic() < deadline, metric(url, "gramserve_worker_slots_in_use")
        time.sleep(0.05)


def test_rows_reach_the_session_that_admitted_them(system):
    """Four sessions fill all 48 slots at once, each asking a length of its own
    (ignore_eos): every request gets exactly its own session's length and one Finished,
    and its tokens equal the same prompt's alone (greedy). A row handed to the wrong
    session would add tokens, or a second Finished, to a tag of that session."""
    v = system["vocab"]
    clients = [GroupClient(system["addrs"]) for _ in range(4)]
    lengths = [3, 5, 7, 9]
    per = SLOTS // len(clients)
    try:
        def one(k: int, i: int):
            return clients[k].generate(f"s{k}-{i}", v.encode(f"session {k} request {i}"),
                                       max_tokens=lengths[k], ignore_eos=True, temperature=0.0)

        with ThreadPoolExecutor(SLOTS) as pool:
            futures = {(k, i): pool.submit(one, k, i)
                       for k in range(len(clients)) for i in range(per)}
            results = {key: f.result(timeout=300) for key, f in futures.items()}
        for (k, _), (tokens, finished) in results.items():
            assert len(tokens) == lengths[k]
            assert finished.reason == common_pb2.FINISH_REASON_LENGTH
            assert finished.usage.completion_tokens == lengths[k]
        for client in clients:
            rows = client.sessions[0].rows
            assert len(rows) == per  # tags 1..per of this session only
            assert all(sum(r.HasField("finished") for r in rs) == 1 for rs in rows.values())
        for k, i in [(0, 0), (3, per - 1)]:
            alone, _ = clients[k].generate(f"again-{k}-{i}", v.encode(f"session {k} request {i}"),
                                           max_tokens=lengths[k], ignore_eos=True,
                                           temperature=0.0)
            assert alone == results[(k, i)][0]
    finally:
        for c in clients:
            c.close()
    _wait_idle(system["urls"][0])


def test_a_vanished_session_frees_its_slots_and_no_other(system):
    """A gateway whose stream ends mid-generation: the engine releases every request it
    held; another session's requests, running beside them, finish untouched."""
    v = system["vocab"]
    leaving, staying = GroupClient(system["addrs"]), GroupClient(system["addrs"])
    try:
        held = []
        for i in range(SLOTS // 2):
            req = worker_pb2.AdmitRequest(
                request_id=f"leave-{i}", slot=-1, prompt_token_ids=v.encode(f"leave {i}"),
                sampling=common_pb2.SamplingParams(max_tokens=200, ignore_eos=True))
            held.append(leaving.admit_all(req))
        for tag, _ in held:
            leaving.sessions[0].wait_tokens(tag, 1)
        with ThreadPoolExecutor(SLOTS // 2) as pool:
            futures = [pool.submit(staying.generate, f"stay-{i}", v.encode(f"stay {i}"),
                                   max_tokens=30, ignore_eos=True, temperature=0.0)
                       for i in range(SLOTS // 2)]
            leaving.close()
            for f in futures:
                tokens, finished = f.result(timeout=300)
                assert len(tokens) == 30
                assert finished.reason == common_pb2.FINISH_REASON_LENGTH
        _wait_idle(system["urls"][0])
        assert metric(system["urls"][0], "gramserve_worker_releases_total",
                      {"reason": "cancelled"}) >= SLOTS // 2
    finally:
        staying.close()


def test_release_and_info_are_answered_by_the_engine(system):
    """Unary calls relayed to the engine process keep their statuses."""
    c = GroupClient(system["addrs"])
    try:
        with pytest.raises(grpc.RpcError) as err:
            c.stubs[0].Release(worker_pb2.ReleaseRequest(slot=SLOTS, request_id="x"), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "slot" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            c.stubs[0].Release(worker_pb2.ReleaseRequest(slot=0, request_id="nobody"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        info = c.stubs[0].Info(worker_pb2.InfoRequest(), timeout=10)
        assert info.num_slots == SLOTS and len(info.slots) == SLOTS and info.serving
    finally:
        c.close()


def _small_group(system, name: str):
    root = system["root"] / name
    root.mkdir()
    return start_group(system["model_dir"], system["grammar"], root, tp=1, slots=4)


def test_engine_killed_takes_its_front_with_it(system):
    """SIGKILL to a rank's engine process: its front sees the socket close and exits, so
    nothing is left holding the rank's port."""
    group, addrs, _ = _small_group(system, "engine-killed")
    try:
        rank, front = _rank_and_front(group.popen.pid)
        os.kill(rank, signal.SIGKILL)
        assert _gone(front, 10.0)
        group.popen.wait(20)  # the launcher stops with its rank
    finally:
        group.stop()


def test_front_killed_stops_its_rank(system):
    """SIGKILL to a rank's front: the engine process cannot serve without it, so it exits
    with status 3 and the launcher with it (a supervisor restarts the group)."""
    group, addrs, _ = _small_group(system, "front-killed")
    try:
        rank, front = _rank_and_front(group.popen.pid)
        os.kill(front, signal.SIGKILL)
        assert group.popen.wait(30) == 3
        assert _gone(rank, 5.0)
    finally:
        group.stop()
