"""The three production failures at system level, through the public API on real processes.

2 ranks, 8 concurrent clients, 300+ requests mixing three JSON schemas, a regex, a choice
list and unguided requests: no invalid output (shared matchers, stale mask rows), no TP
divergence, and every seeded unguided output identical to the same request sent alone to an
idle system (a reused slot behaves like a fresh one; guided neighbours leave no trace).
"""

import json
import random
import threading

from constraints import constraint_mix, is_valid
from procs import metric

from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from protos.rpc import channel

REQUESTS, CLIENTS, MAX_TOKENS = 312, 8, 32
DONE = (common_pb2.FINISH_REASON_GRAMMAR_COMPLETED, common_pb2.FINISH_REASON_STOP)
COMPACT = common_pb2.GrammarOptions(whitespace=common_pb2.WHITESPACE_COMPACT)


def _request(kind, arg, seed):
    req = gateway_pb2.GenerateRequest(prompt=f"Record {seed % 7}:", sampling=common_pb2.SamplingParams(
        max_tokens=MAX_TOKENS, seed=seed, temperature=1.0))
    if kind == "json_schema":
        req.constraint.json_schema = json.dumps(arg)
        req.constraint.options.CopyFrom(COMPACT)
    elif kind == "regex":
        req.constraint.regex = arg
    elif kind == "choice":
        req.constraint.choice.choices.extend(arg)
    return req


def _final(stub, req):
    out = list(stub.Generate(req, timeout=300))
    final = out[-1].final
    assert "".join(r.delta.text for r in out[:-1]) == final.text
    return final


def test_mixed_load_has_no_invalid_output_no_divergence_and_stable_unguided(gramserve_system):
    with channel(gramserve_system.gateways[0]) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        mix = constraint_mix()
        rng = random.Random(7)
        work = [(kind, arg, 1000 + i) for i, (kind, arg) in
                enumerate(rng.choice(mix) for _ in range(REQUESTS))]
        unguided_seeds = [s for k, _, s in work if k == "none"][:12]
        alone = {s: _final(stub, _request("none", None, s)).text for s in unguided_seeds}

        results, errors, lock = {}, [], threading.Lock()
        todo = iter(list(enumerate(work)))

        def client():
            while True:
                with lock:
                    item = next(todo, None)
                if item is None:
                    return
                i, (kind, arg, seed) = item
                try:
                    final = _final(stub, _request(kind, arg, seed))
                except Exception as exc:  # collected, reported below
                    with lock:
                        errors.append((i, kind, repr(exc)))
                    continue
                with lock:
                    results[i] = final

        threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    assert not errors, errors[:5]
    assert len(results) == REQUESTS
    invalid = []
    for i, (kind, arg, _) in enumerate(work):
        final = results[i]
        if kind == "none":
            continue
        if final.finish_reason not in DONE or not is_valid(kind, arg, final.text):
            invalid.append((kind, final.finish_reason, final.text))
        if kind == "json_schema" and not final.schema_valid:
            invalid.append((kind, "schema_valid false", final.schema_error))
    assert not invalid, invalid[:5]
    changed = [(s, alone[s], results[i].text) for i, (k, _, s) in enumerate(work)
               if k == "none" and s in alone and results[i].text != alone[s]]
    assert not changed, changed[:3]
    assert len(alone) == 12
    for url in gramserve_system.rank_metrics:
        assert metric(url, "gramserve_worker_tp_divergence_total") == 0
    assert gramserve_system.wait_slots_free() == [0, 0]
