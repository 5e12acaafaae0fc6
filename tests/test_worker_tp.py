"""Worker ranks as real processes over gloo, driven through their gRPC service: TP=2 lockstep
(I2, I3), guided decoding with every rank's own matchers (I1), slot reuse (I5), the lifecycle
errors, and a rank that loses its peer."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from constraints import constraint_mix, is_valid
from worker_procs import (
    AdmitError,
    GroupClient,
    compile_ref,
    compile_spec,
    metric,
    start_grammar_service,
    start_group,
)

from grammar_service.default_model import ensure_default_model
from grammar_service.vocab import load_vocab
from protos import common_pb2, worker_pb2


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    model_dir = ensure_default_model(root / "models")
    procs = []
    try:
        gs, gaddr = start_grammar_service(model_dir, root)
        procs.append(gs)
        # Every shortcut on, drafts too, and fused sampling points (off by default on CPU;
        # here under the Triton interpreter): TP=2 against the plain group below.
        g2, addrs2, metrics2 = start_group(model_dir, gaddr, root, tp=2, slots=4,
                                           extra=["--step-tokens", "32", "--draft-tokens", "2",
                                                  "--fused-sampling", "on"])
        procs.append(g2)
        g1, addrs1, metrics1 = start_group(model_dir, gaddr, root, tp=1, slots=4)
        procs.append(g1)
        # The same TP=2 group with forced tokens and accept-first off: the reference outputs.
        g0, addrs0, metrics0 = start_group(model_dir, gaddr, root, tp=2, slots=4,
                                           extra=["--step-tokens", "32", "--no-forced-tokens",
                                                  "--no-accept-first"])
        procs.append(g0)
        keys = {}
        for i, (kind, arg) in enumerate(constraint_mix()):
            if kind != "none":
                keys[i] = compile_spec(gaddr, kind, arg)
        yield {"model_dir": model_dir, "vocab": load_vocab(model_dir), "grammar": gaddr,
               "tp2": GroupClient(addrs2), "tp2_metrics": metrics2, "tp2_proc": g2,
               "tp2_addrs": addrs2,
               "tp1": GroupClient(addrs1), "tp1_metrics": metrics1, "keys": keys, "root": root,
               "tp2_plain": GroupClient(addrs0), "tp2_plain_metrics": metrics0}
    finally:
        for p in reversed(procs):
            p.stop()


def wait_idle(urls, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(metric(u, "gramserve_worker_slots_in_use") == 0 for u in urls):
            return
        time.sleep(0.1)
    raise AssertionError([metric(u, "gramserve_worker_slots_in_use") for u in urls])


def test_tp2_greedy_matches_tp1_on_20_prompts(system):
    v = system["vocab"]
    for i in range(20):
        prompt = v.encode(f"prompt number {i}: the answer is")
        kw = dict(max_tokens=32, temperature=0.0, ignore_eos=True)
        t2, f2 = system["tp2"].generate(f"g2-{i}", prompt, **kw)
        t1, f1 = system["tp1"].generate(f"g1-{i}", prompt, **kw)
        assert f2.reason == f1.reason == common_pb2.FINISH_REASON_LENGTH
        assert t2 == t1, i
    for url in system["tp2_metrics"]:
        assert metric(url, "gramserve_worker_tp_divergence_total") == 0


def test_tp2_guided_100_requests_4_concurrent_every_output_valid(system):
    mix = constraint_mix()
    guided = [i for i, (k, _) in enumerate(mix) if k != "none"]
    v = system["vocab"]

    def one(n):
        i = guided[n % len(guided)]
        key, spec = system["keys"][i]
        toks, fin = system["tp2"].generate(f"guided-{n}", v.encode(f"request {n}"), key=key,
                                           spec=spec, max_tokens=48, seed=n)
        return i, v.decode(toks), fin

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(100)))
    for i, text, fin in results:
        kind, arg = mix[i]
        assert fin.reason == common_pb2.FINISH_REASON_GRAMMAR_COMPLETED, (kind, fin)
        assert is_valid(kind, arg, text), (kind, text)
    for url in system["tp2_metrics"]:
        assert metric(url, "gramserve_worker_tp_divergence_total") == 0
    wait_idle(system["tp2_metrics"])


def test_tp2_shortcuts_give_the_tokens_of_plain_mask_first_sampling(system):
    """Forced tokens and accept-first (on by default), with drafts and fused sampling points,
    against a TP=2 group with all of them off: the same tokens for greedy and seeded
    temperature sampling over every constraint of the mix, with every mechanism at work on
    every rank, and both ranks fusing the same sampling points."""
    mix = constraint_mix()
    v = system["vocab"]
    for i, (kind, _) in enumerate(mix):
        key, spec = system["keys"].get(i, ("", None))
        for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 40 + i}):
            args = dict(key=key, spec=spec, max_tokens=40, **sampling)
            on = system["tp2"].generate(f"on-{i}-{sampling['temperature']}",
                                        v.encode(f"shortcut {i}"), **args)
            off = system["tp2_plain"].generate(f"off-{i}-{sampling['temperature']}",
                                               v.encode(f"shortcut {i}"), **args)
            assert on[0] == off[0] and on[1].reason == off[1].reason, (kind, sampling)
    for url in system["tp2_metrics"]:
        assert metric(url, "gramserve_worker_forced_tokens_total") > 0
        assert metric(url, "gramserve_worker_accept_first_total") > 0
        assert metric(url, "gramserve_worker_tp_divergence_total") == 0
    for url in system["tp2_plain_metrics"]:
        assert metric(url, "gramserve_worker_forced_tokens_total") == 0
        assert metric(url, "gramserve_worker_accept_first_total") == 0
    wait_idle(system["tp2_metrics"] + system["tp2_plain_metrics"])  # both ranks done
    # Both ranks ran the same sampling points the same way (I3): fused where every row
    # samples with temperature only, op by op where a row asks for more.
    for path in ("fused", "op_by_op"):
        ranks = [metric(url, "gramserve_worker_sampling_points_total", {"path": path})
                 for url in system["tp2_metrics"]]
        assert ranks[0] == ranks[1] and (path == "op_by_op" or ranks[0] > 0), (path, ranks)
    assert metric(system["tp2_plain_metrics"][0], "gramserve_worker_sampling_points_total",
                  {"path": "fused"}) == 0


def test_tp2_drafts_give_the_tokens_of_plain_mask_first_sampling(system):
    """Drafted tokens (on by default on CUDA; this group turns them on) against the TP=2
    group with every shortcut off: the same tokens, greedy and seeded temperature, under a
    permissive regex that the random weights mostly follow (so accept-first holds). A prompt sent again meets the draft tables its
    first answer filled, on each rank from its own commits: drafts are verified and kept on
    both ranks alike (no divergence). Long answers, since after the mix above a new row may
    start backed off to mask-first for 64 tokens."""
    v = system["vocab"]
    key, spec = compile_spec(system["grammar"], "regex", r"[^\n]{0,500}")
    for n, sampling in enumerate(({"temperature": 0.0}, {"temperature": 0.0},
                                  {"temperature": 1.0, "seed": 7}, {"temperature": 1.0, "seed": 7})):
        args = dict(key=key, spec=spec, max_tokens=110, **sampling)
        prompt = v.encode(f"draft {sampling['temperature']}")
        on = system["tp2"].generate(f"draft-on-{n}", prompt, **args)
        off = system["tp2_plain"].generate(f"draft-off-{n}", prompt, **args)
        assert on[0] == off[0] and on[1].reason == off[1].reason, sampling
    for url in system["tp2_metrics"]:
        assert metric(url, "gramserve_worker_draft_accepted_total") > 10
        assert metric(url, "gramserve_worker_tp_divergence_total") == 0
    ranks = [metric(url, "gramserve_worker_drafted_tokens_total") for url in system["tp2_metrics"]]
    assert ranks[0] == ranks[1] > 0
    for url in system["tp2_plain_metrics"]:
        assert metric(url, "gramserve_worker_drafted_tokens_total") == 0
    wait_idle(system["tp2_metrics"] + system["tp2_plain_metrics"])


def test_slot_reuse_300_requests_cycling_constraints(system):
    """300 requests through 4 slots in a seeded random order: every guided output valid for
    its own constraint, every unguided output equal to the same request on a fresh worker."""
    mix = constraint_mix()
    v = system["vocab"]
    rng = random.Random(1234)
    plan = [(n, rng.randrange(len(mix)), rng.randrange(1 << 31)) for n in range(300)]

    def one(item):
        n, i, seed = item
        kind, _ = mix[i]
        key, spec = system["keys"].get(i, ("", None))
        return system["tp2"].generate(f"reuse-{n}", v.encode(f"r {n}"), key=key, spec=spec,
                                      max_tokens=40 if kind != "none" else 12, seed=seed)

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, plan))
    unguided = []
    for (n, i, seed), (toks, fin) in zip(plan, results, strict=True):
        kind, arg = mix[i]
        if kind == "none":
            unguided.append((n, seed, toks))
        else:
            assert fin.reason == common_pb2.FINISH_REASON_GRAMMAR_COMPLETED, (n, kind, fin)
            assert is_valid(kind, arg, v.decode(toks)), (n, kind, v.decode(toks))
    assert len(unguided) > 20
    for n, seed, toks in unguided[:20]:
        alone, _ = system["tp1"].generate(f"fresh-{n}", v.encode(f"r {n}"), max_tokens=12,
                                          seed=seed)
        assert alone == toks, n
    wait_idle(system["tp2_metrics"])


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_tp2_each_backend_forced_serves_valid_outputs_through_reused_slots(system, backend):
    """Every guided constraint compiled by one backend (forced), 40 requests through 4 slots
    at TP=2 mixed with unguided ones: each rank builds that backend's matchers (I1), the
    ranks stay in lockstep (no divergence), every guided output is valid and completed by
    its grammar, and the slots come back (I5)."""
    mix = constraint_mix()
    forced = {"xgrammar": common_pb2.GRAMMAR_BACKEND_XGRAMMAR,
              "llguidance": common_pb2.GRAMMAR_BACKEND_LLGUIDANCE}[backend]
    refs = {}
    for i, (kind, arg) in enumerate(mix):
        if kind != "none":
            key, spec, ref = compile_ref(system["grammar"], kind, arg, forced)
            assert ref.backend == backend, (kind, ref)
            refs[i] = (key, spec)
    v = system["vocab"]
    before = [metric(u, "gramserve_worker_tp_divergence_total") for u in system["tp2_metrics"]]

    def one(n):
        i = n % len(mix)
        key, spec = refs.get(i, ("", None))
        toks, fin = system["tp2"].generate(f"{backend}-{n}", v.encode(f"{backend} {n}"),
                                           key=key, spec=spec, seed=n,
                                           max_tokens=48 if key else 8)
        return i, v.decode(toks), fin

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(40)))
    for i, text, fin in results:
        kind, arg = mix[i]
        if kind != "none":
            assert fin.reason == common_pb2.FINISH_REASON_GRAMMAR_COMPLETED, (kind, fin)
            assert is_valid(kind, arg, text), (kind, text)
    after = [metric(u, "gramserve_worker_tp_divergence_total") for u in system["tp2_metrics"]]
    assert after == before
    wait_idle(system["tp2_metrics"])


def _admit(client, rid, prompt, **sampling):
    """Admit on every rank; return (request, rank 0's tag, slot)."""
    req = worker_pb2.AdmitRequest(request_id=rid, slot=-1, prompt_token_ids=prompt,
                                  sampling=common_pb2.SamplingParams(**sampling))
    tag, slot = client.admit_all(req, timeout=60)
    return req, tag, slot


def _refused(session, req) -> AdmitError:
    with pytest.raises(AdmitError) as err:
        session.admit(req, timeout=10)
    return err.value


def test_lifecycle_errors_leak_nothing(system):
    c, v = system["tp2"], system["vocab"]
    rank0, rank1 = c.sessions
    # Too-long prompt.
    err = _refused(rank0, worker_pb2.AdmitRequest(request_id="long", slot=-1,
                                                  prompt_token_ids=[5] * 300))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in err.details
    # Rank 0 does not take a slot number.
    err = _refused(rank0, worker_pb2.AdmitRequest(request_id="x", slot=2, prompt_token_ids=[5]))
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    # Admit to a busy slot, stale and double Release, Release during prefill.
    req, tag, slot = _admit(c, "busy", v.encode("hello"), max_tokens=200, ignore_eos=True)
    rank0.wait_tokens(tag, 1)  # it runs
    intruder = worker_pb2.AdmitRequest(request_id="intruder", slot=slot, prompt_token_ids=[5])
    assert _refused(rank1, intruder).code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as rpc_err:
        c.stubs[1].Release(worker_pb2.ReleaseRequest(slot=slot, request_id="stale"), timeout=10)
    assert rpc_err.value.code() == grpc.StatusCode.NOT_FOUND
    assert c.stubs[1].Release(worker_pb2.ReleaseRequest(slot=slot, request_id="busy")).was_running
    _, finished = rank0.finished(tag)
    assert finished.reason == common_pb2.FINISH_REASON_CANCELLED
    with pytest.raises(grpc.RpcError) as rpc_err:
        c.stubs[0].Release(worker_pb2.ReleaseRequest(slot=slot, request_id="busy"), timeout=10)
    assert rpc_err.value.code() == grpc.StatusCode.NOT_FOUND
    # Release while the prompt is still being prefilled (a long prompt, released at once).
    prompt = v.encode("word " * 60)
    assert len(prompt) > 3 * 32  # several steps of prefill at --step-tokens 32
    req, tag, slot = _admit(c, "prefill", prompt, max_tokens=5)
    deadline = time.monotonic() + 10
    while c.stubs[0].Info(worker_pb2.InfoRequest()).slots[slot].state != \
            worker_pb2.SLOT_STATE_PREFILL:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert c.stubs[0].Release(worker_pb2.ReleaseRequest(slot=slot, request_id="prefill"),
                              timeout=10).was_running
    tokens, finished = rank0.finished(tag)
    assert finished.reason == common_pb2.FINISH_REASON_CANCELLED and not tokens
    # An allocation whose Admit never reaches rank 1 expires (admit timeout 60 s by default):
    # closing the gateway's session on rank 0 frees it at once instead.
    orphan_client = GroupClient(system["tp2_addrs"])
    orphan_client.sessions[0].admit(worker_pb2.AdmitRequest(
        request_id="orphan", slot=-1, prompt_token_ids=v.encode("hi")), timeout=10)
    orphan_client.close()
    wait_idle(system["tp2_metrics"])


def test_health_and_info_answer_while_every_slot_streams(system):
    """The transport holds no server thread per request: with every slot of the group busy
    and more admissions queued behind them, health and Info answer at once."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    c, v = system["tp2"], system["vocab"]
    held = [_admit(c, f"hold-{i}", v.encode(f"hold {i}"), max_tokens=60, ignore_eos=True)
            for i in range(4)]
    try:
        for ch in c.channels:
            t0 = time.monotonic()
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=1.0)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            assert time.monotonic() - t0 < 1.0
        info = c.stubs[0].Info(worker_pb2.InfoRequest(), timeout=1.0)
        assert sum(s.state != worker_pb2.SLOT_STATE_FREE for s in info.slots) == 4
    finally:
        for req, _, slot in held:
            c.release_all(slot, req.request_id)
    wait_idle(system["tp2_metrics"])


def test_one_update_per_step_from_rank0_only(system):
    """Message count on the wire: rank 0 sends one StepUpdate per step for all of a session's
    rows, whatever the number of running requests; followers send none."""
    v = system["vocab"]
    client = GroupClient(system["tp2_addrs"])
    try:
        reqs = [_admit(client, f"count-{i}", v.encode(f"count {i}"), max_tokens=20,
                       ignore_eos=True, temperature=0.0) for i in range(4)]
        results = [client.sessions[0].finished(tag) for _, tag, _ in reqs]
        assert all(len(toks) == 20 for toks, _ in results)
        # 4 requests x 20 tokens = 80 rows; they ran together, so far fewer messages than
        # rows (one per step) and at most one message per step of the longest request
        # plus the steps in which the later admissions were still starting.
        updates = client.sessions[0].updates
        rows = sum(len(r) for r in client.sessions[0].rows.values())
        # (Admissions are staggered by a loaded CPU: allow 16 such steps.)
        assert rows >= 80 and updates <= 20 + 16 and updates < rows / 2, (updates, rows)
        assert client.sessions[1].updates == 0
    finally:
        client.close()
    wait_idle(system["tp2_metrics"])


def test_killed_rank_makes_its_peer_exit_in_bounded_time(system):
    """SIGKILL rank 1 mid-generation: rank 0 fails the request with UNAVAILABLE, reports
    NOT_SERVING and exits by itself, well within the collective timeout plus a margin."""
    import os
    import signal

    from procs import Child, free_port, wait_serving

    ports = [free_port() for _ in range(3)]
    common = ["--tp", "2", "--dist-addr", f"127.0.0.1:{ports[2]}", "--model",
              str(system["model_dir"]), "--grammar-service", system["grammar"], "--device", "cpu",
              "--slots", "2", "--max-model-len", "256", "--collective-timeout", "5",
              "--torch-threads", "1", "--metrics-port", "-1"]
    ranks = [Child(f"kill-rank{r}", ["gpu_worker", "--rank", str(r), "--port", str(ports[r]),
                                     *common], system["root"]) for r in range(2)]
    addrs = [f"127.0.0.1:{p}" for p in ports[:2]]
    client = GroupClient(addrs)
    try:
        wait_serving(addrs, ranks)
        v = system["vocab"]
        req, tag, slot = _admit(client, "victim", v.encode("hello"), max_tokens=250,
                                ignore_eos=True)
        client.sessions[0].wait_tokens(tag, 1)
        os.kill(ranks[1].popen.pid, signal.SIGKILL)
        t0 = time.monotonic()
        try:
            _, finished = client.sessions[0].finished(tag, timeout=30)
            assert finished.code == grpc.StatusCode.UNAVAILABLE.value[0], finished
        except grpc.RpcError as exc:  # or the stream broke as rank 0 exited
            assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        ranks[0].popen.wait(timeout=30)
        assert ranks[0].popen.returncode != 0
        assert time.monotonic() - t0 < 30
    finally:
        client.close()
        for p in ranks:
            p.stop()


def test_sigterm_drains_the_group_running_request_finishes_new_ones_refused(system):
    """SIGTERM to a group's launcher, as Kubernetes stops a worker pod: every rank turns
    NOT_SERVING and refuses admissions with UNAVAILABLE (the gateway admits elsewhere), the
    running request still gets all its tokens, and every rank exits 0 (the lockstep held to
    the last step: a rank left waiting in a collective would exit 3)."""
    import os
    import signal

    from worker_procs import start_group

    from protos.rpc import check_health

    proc, addrs, _ = start_group(system["model_dir"], system["grammar"], system["root"], tp=2,
                                 slots=2, extra=["--drain-timeout", "60"])
    client = GroupClient(addrs)
    try:
        v = system["vocab"]
        _, tag, _ = _admit(client, "drained", v.encode("hello"), max_tokens=240,
                           ignore_eos=True)
        client.sessions[0].wait_tokens(tag, 1)
        os.kill(proc.popen.pid, signal.SIGTERM)  # the launcher passes it to every rank
        deadline = time.monotonic() + 10
        while any(check_health(a, timeout=1) for a in addrs):
            assert time.monotonic() < deadline, "still SERVING after SIGTERM"
            time.sleep(0.05)
        err = _refused(client.sessions[0], worker_pb2.AdmitRequest(
            request_id="late", slot=-1, prompt_token_ids=v.encode("hi")))
        assert err.code == grpc.StatusCode.UNAVAILABLE and "draining" in err.details, err
        tokens, finished = client.sessions[0].finished(tag, timeout=120)
        assert finished.reason == common_pb2.FINISH_REASON_LENGTH, finished
        assert len(tokens) == 240
        assert proc.popen.wait(timeout=60) == 0
    finally:
        client.close()
        proc.stop()
