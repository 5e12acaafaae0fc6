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
from worker_procs import GroupClient, compile_spec, metric, start_grammar_service, start_group

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
        g2, addrs2, metrics2 = start_group(model_dir, gaddr, root, tp=2, slots=4,
                                           extra=["--step-tokens", "32"])
        procs.append(g2)
        g1, addrs1, metrics1 = start_group(model_dir, gaddr, root, tp=1, slots=4)
        procs.append(g1)
        keys = {}
        for i, (kind, arg) in enumerate(constraint_mix()):
            if kind != "none":
                keys[i] = compile_spec(gaddr, kind, arg)
        yield {"model_dir": model_dir, "vocab": load_vocab(model_dir), "grammar": gaddr,
               "tp2": GroupClient(addrs2), "tp2_metrics": metrics2, "tp2_proc": g2,
               "tp1": GroupClient(addrs1), "tp1_metrics": metrics1, "keys": keys, "root": root}
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


def _admit_rank0(client, rid, prompt, **sampling):
    req = worker_pb2.AdmitRequest(request_id=rid, slot=-1, prompt_token_ids=prompt,
                                  sampling=common_pb2.SamplingParams(**sampling))
    stream = client.stubs[0].Admit(req, timeout=60)
    return req, stream, next(stream).admitted.slot


def test_lifecycle_errors_leak_nothing(system):
    c, v = system["tp2"], system["vocab"]
    # Too-long prompt.
    with pytest.raises(grpc.RpcError) as err:
        list(c.stubs[0].Admit(worker_pb2.AdmitRequest(
            request_id="long", slot=-1, prompt_token_ids=[5] * 300), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_token_ids" in err.value.details()
    # Rank 0 does not take a slot number.
    with pytest.raises(grpc.RpcError) as err:
        list(c.stubs[0].Admit(worker_pb2.AdmitRequest(
            request_id="x", slot=2, prompt_token_ids=[5]), timeout=10))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # Admit to a busy slot, stale and double Release, Release during prefill.
    req, stream, slot = _admit_rank0(c, "busy", v.encode("hello"), max_tokens=200,
                                     ignore_eos=True)
    list(c.stubs[1].Admit(GroupClient._with_slot(req, slot), timeout=10))
    next(stream)  # it runs
    intruder = worker_pb2.AdmitRequest(request_id="intruder", slot=slot, prompt_token_ids=[5])
    with pytest.raises(grpc.RpcError) as err:
        list(c.stubs[1].Admit(intruder, timeout=10))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as err:
        c.stubs[1].Release(worker_pb2.ReleaseRequest(slot=slot, request_id="stale"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert c.stubs[1].Release(worker_pb2.ReleaseRequest(slot=slot, request_id="busy")).was_running
    finished = [e for e in stream if e.HasField("finished")]
    assert finished[0].finished.reason == common_pb2.FINISH_REASON_CANCELLED
    with pytest.raises(grpc.RpcError) as err:
        c.stubs[0].Release(worker_pb2.ReleaseRequest(slot=slot, request_id="busy"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    # Release while the prompt is still being prefilled (a long prompt, released at once).
    req, stream, slot = _admit_rank0(c, "prefill", v.encode("word " * 60), max_tokens=5)
    assert len(req.prompt_token_ids) > 3 * 32  # several steps of prefill at --step-tokens 32
    list(c.stubs[1].Admit(GroupClient._with_slot(req, slot), timeout=10))
    deadline = time.monotonic() + 10
    while c.stubs[0].Info(worker_pb2.InfoRequest()).slots[slot].state != \
            worker_pb2.SLOT_STATE_PREFILL:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert c.stubs[0].Release(worker_pb2.ReleaseRequest(slot=slot, request_id="prefill"),
                              timeout=10).was_running
    events = list(stream)
    assert events[-1].finished.reason == common_pb2.FINISH_REASON_CANCELLED
    assert not any(e.HasField("tokens") for e in events)
    # An allocation whose Admit never reaches rank 1 expires (admit timeout 10 s by default):
    # cancelling the rank-0 stream frees it at once instead.
    req, stream, slot = _admit_rank0(c, "orphan", v.encode("hi"))
    stream.cancel()
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
        req, stream, slot = _admit_rank0(client, "victim", v.encode("hello"), max_tokens=250,
                                         ignore_eos=True)
        list(client.stubs[1].Admit(GroupClient._with_slot(req, slot), timeout=10))
        next(stream)
        os.kill(ranks[1].popen.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        ranks[0].popen.wait(timeout=30)
        assert ranks[0].popen.returncode != 0
        assert time.monotonic() - t0 < 30
    finally:
        client.close()
        for p in ranks:
            p.stop()
