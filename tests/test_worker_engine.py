"""The engine of one rank, in process: batch invariance, slot reuse (I5), mixed batches (I4),
own matchers (I1), dead ends (I6) and the finish rules. Real model, real xgrammar, the real
Triton mask kernel under the interpreter (`triton_masks`: a CPU worker applies masks with
xgrammar's C++ kernel, which the last test holds to the same tokens)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import threading
import time

import pytest
import tokenizers
import xgrammar as xgr
from constraints import SCHEMAS, constraint_mix, is_valid
from engine_harness import EngineHarness

from gpu_worker.control.engine import (
    DEAD_END,
    GRAMMAR_COMPLETED,
    LENGTH,
    STOP,
    UNAVAILABLE,
    Request,
    _IndexStage,
)
from grammar_service.default_model import ensure_default_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_default_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def harness(model_dir):
    return EngineHarness(model_dir, slots=4, triton_masks=True)


@pytest.fixture(scope="module")
def compiled(harness):
    """Compiled grammars of the constraint mix, by index (each matcher is built per request)."""
    compiler = xgr.GrammarCompiler(harness.vocab.tokenizer_info(), max_threads=1)
    out = {}
    for i, (kind, arg) in enumerate(constraint_mix()):
        if kind == "json_schema":
            out[i] = compiler.compile_json_schema(json.dumps(arg), any_whitespace=False)
        elif kind == "regex":
            out[i] = compiler.compile_regex(arg)
        elif kind == "choice":
            out[i] = compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(c) for c in arg))
    return out


def make(harness, rid, prompt="hello", seed=1, max_tokens=24, temperature=1.0, compiled=None,
         **kw) -> Request:
    req = Request(request_id=rid, prompt=harness.vocab.encode(prompt), max_tokens=max_tokens,
                  temperature=temperature, seed=seed, **kw)
    if compiled is not None:
        req.matcher = xgr.GrammarMatcher(compiled)
    return req


def text(harness, outcome) -> str:
    return harness.vocab.decode(outcome.tokens)


def test_seeded_request_same_alone_and_in_full_batch_in_any_slot(harness):
    alone = harness.run([make(harness, "solo", seed=7)])["solo"]
    for position in range(4):
        others = [make(harness, f"o{position}-{i}", prompt=f"other {i}", seed=100 + i)
                  for i in range(3)]
        batch = others[:position] + [make(harness, f"t{position}", seed=7)] + others[position:]
        got = harness.run(batch)[f"t{position}"]
        assert got.slot == position
        assert got.tokens == alone.tokens


def test_greedy_is_argmax_and_reproducible(harness):
    a = harness.run([make(harness, "g1", temperature=0.0)])["g1"]
    b = harness.run([make(harness, "g2", temperature=0.0),
                     make(harness, "g3", prompt="x", temperature=0.0)])["g2"]
    assert a.tokens == b.tokens and a.reason in (LENGTH, STOP)


def test_slot_reuse_200_requests_match_fresh_engine(harness, model_dir):
    rng = random.Random(0)
    specs = [(f"r{i}", f"prompt {rng.randrange(1000)}", rng.randrange(1 << 30),
              rng.choice([0.0, 0.7, 1.0]), rng.randrange(1, 12)) for i in range(200)]
    reused = harness.run([make(harness, rid, p, s, mt, t) for rid, p, s, t, mt in specs])
    fresh = EngineHarness(model_dir, slots=4)
    for rid, p, s, t, mt in specs[::25]:
        alone = fresh.run([make(fresh, rid, p, s, mt, t)])[rid]
        assert reused[rid].tokens == alone.tokens, rid


def test_unguided_output_unchanged_by_guided_neighbours(harness, compiled):
    mix = constraint_mix()
    alone = harness.run([make(harness, "u", prompt="free text", seed=3, max_tokens=32)])["u"]
    reqs = [make(harness, "u", prompt="free text", seed=3, max_tokens=32)]
    reqs += [make(harness, f"g{i}", prompt="data", seed=10 + i, max_tokens=48,
                  compiled=compiled[i]) for i in compiled]
    out = harness.run(reqs)
    assert out["u"].tokens == alone.tokens
    for i in compiled:
        kind, arg = mix[i]
        o = out[f"g{i}"]
        assert o.reason == GRAMMAR_COMPLETED, (kind, o)
        assert is_valid(kind, arg, text(harness, o)), (kind, text(harness, o))


def test_slot_reuse_cycling_constraints_every_output_valid(harness, compiled, model_dir):
    mix = constraint_mix()
    rng = random.Random(42)
    reqs, kinds = [], {}
    for n in range(60):
        i = rng.randrange(len(mix))
        rid = f"c{n}"
        kinds[rid] = i
        reqs.append(make(harness, rid, prompt=f"item {n}", seed=n, max_tokens=48,
                         compiled=compiled.get(i)))
    out = harness.run(reqs)
    for rid, i in kinds.items():
        kind, arg = mix[i]
        if kind != "none":
            assert out[rid].reason == GRAMMAR_COMPLETED, (rid, kind, out[rid])
            assert is_valid(kind, arg, text(harness, out[rid])), (rid, text(harness, out[rid]))


def test_release_mid_generation_then_reuse_slot_with_other_schema(harness, compiled):
    first = harness.run([make(harness, "long", max_tokens=40, compiled=compiled[0])],
                        release_after={"long": 1})["long"]
    assert first.reason == "cancelled" and len(first.tokens) >= 1
    second = harness.run([make(harness, "next", compiled=compiled[1], max_tokens=48)])["next"]
    assert second.slot == first.slot
    assert second.reason == GRAMMAR_COMPLETED
    assert is_valid("json_schema", SCHEMAS[1], text(harness, second))


def test_max_tokens_min_tokens_and_stop_ids(harness):
    out = harness.run([make(harness, "len", max_tokens=5, ignore_eos=True)])["len"]
    assert out.reason == LENGTH and len(out.tokens) == 5
    first = harness.run([make(harness, "probe", temperature=0.0, max_tokens=3)])["probe"]
    stop_id = first.tokens[1]
    out = harness.run([make(harness, "stop", temperature=0.0, max_tokens=10,
                            stop_token_ids=frozenset({stop_id}))])["stop"]
    assert out.reason == STOP and out.tokens == first.tokens[:1]  # the stop id is not emitted
    out = harness.run([make(harness, "min", temperature=0.0, max_tokens=10, min_tokens=4,
                            stop_token_ids=frozenset({stop_id}))])["min"]
    assert len(out.tokens) >= 4 and stop_id not in out.tokens[:4]


def _tokenizer_without(tmp_path, missing: str):
    """A byte-level BPE whose vocabulary has no token containing `missing`."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    alphabet = [c for c in tokenizers.pre_tokenizers.ByteLevel.alphabet() if c != missing]
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet,
                                             special_tokens=["<eos>"], limit_alphabet=len(alphabet))
    corpus = ["hello world, abc abc the quick brown fox"] * 50
    tok.train_from_iterator([c.replace(missing, "") for c in corpus], trainer)
    assert all(missing not in t for t in tok.get_vocab())
    return tok


def test_dead_end_fails_one_request_and_spares_the_others(tmp_path, model_dir):
    """A grammar that needs 'z' right after 'a' with a vocabulary that cannot spell 'z': the
    matcher allows 'a' (a valid prefix), then nothing. That request ends with a dead-end
    error; the unguided request beside it is unaffected and no NaN appears."""
    import shutil

    d = tmp_path / "no-z"
    shutil.copytree(model_dir, d)
    tok = _tokenizer_without(tmp_path, "z")
    tok.save(str(d / "tokenizer.json"))
    cfg = json.loads((d / "config.json").read_text())
    eos = tok.token_to_id("<eos>")
    cfg.update(eos_token_id=eos, bos_token_id=eos, pad_token_id=eos)
    (d / "config.json").write_text(json.dumps(cfg))
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc.update(eos_token="<eos>", bos_token="<eos>", pad_token="<eos>", add_bos_token=False)
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    h = EngineHarness(d, slots=2)
    grammar = xgr.GrammarCompiler(h.vocab.tokenizer_info()).compile_grammar('root ::= "az"')
    solo = h.run([make(h, "free", seed=5, max_tokens=12)])["free"]
    out = h.run([make(h, "dead", compiled=grammar), make(h, "free", seed=5, max_tokens=12)])
    assert out["dead"].reason == DEAD_END and "allows no token" in out["dead"].message
    assert h.vocab.decode(out["dead"].tokens) == "a"
    assert out["free"].tokens == solo.tokens
    assert h.table.in_use() == 0


def test_nan_logits_fail_that_request_as_their_own_error_not_a_dead_end(model_dir):
    """A model that gives NaN for one request (its prompt holds a token whose embedding is
    NaN) fails that request with an error that says so, not a grammar dead end; the
    request beside it, which never sees that token, is unaffected."""
    import torch
    from prometheus_client import CollectorRegistry

    from gpu_worker.control.engine import INTERNAL
    from gpu_worker.metrics import WorkerMetrics

    h = EngineHarness(model_dir, slots=2)
    h.engine.metrics = metrics = WorkerMetrics(registry := CollectorRegistry())
    solo = h.run([make(h, "free", seed=5, max_tokens=8)])["free"]
    seen = set(h.vocab.encode("hello")) | set(solo.tokens)
    poison = next(i for i in range(h.vocab.vocab_size - 1, 0, -1) if i not in seen)
    with torch.no_grad():
        h.engine.model.embed.weight[poison] = float("nan")
    grammar = xgr.GrammarCompiler(h.vocab.tokenizer_info()).compile_regex("[a-z]+")
    for compiled in (None, grammar):
        nan = make(h, "nan", compiled=compiled)
        nan.prompt = [poison]
        out = h.run([nan, make(h, "free", seed=5, max_tokens=8)])
        assert out["nan"].reason == INTERNAL and "NaN or infinite logits" in out["nan"].message
        assert out["free"].tokens == solo.tokens
    assert registry.get_sample_value("gramserve_worker_nonfinite_logits_total") == 2
    assert registry.get_sample_value("gramserve_worker_grammar_dead_ends_total") == 0
    assert h.table.in_use() == 0 and metrics is h.engine.metrics
    # Every recorded step has the engine thread's CPU time beside its wall time.
    steps = sum(registry.get_sample_value("gramserve_worker_step_seconds_count",
                                          {"phase": p}) or 0 for p in ("decode", "prefill", "mixed"))
    assert steps > 0
    assert registry.get_sample_value("gramserve_worker_step_cpu_seconds_count") == steps
    assert 0 < registry.get_sample_value("gramserve_worker_step_cpu_seconds_sum")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_steps_with_prefill_chunks_give_the_tokens_of_requests_run_alone(model_dir, temperature):
    """Prompts of very different lengths arrive while others decode, under a small step
    budget, so most steps carry prefill chunks beside decode rows: every request's tokens
    equal the same request run alone on an idle engine (greedy and seeded sampling)."""
    busy = EngineHarness(model_dir, slots=6, step_tokens=16)
    lengths = [3, 40, 7, 65, 1, 22, 90, 12]
    reqs = [make(busy, f"p{i}", prompt=" ".join(f"w{j}" for j in range(n)), seed=100 + i,
                 temperature=temperature, max_tokens=12, ignore_eos=True)
            for i, n in enumerate(lengths)]
    together = busy.run(reqs)
    solo = EngineHarness(model_dir, slots=1, step_tokens=512)
    for r in reqs:
        again = make(solo, r.request_id, seed=r.seed, temperature=temperature, max_tokens=12,
                     ignore_eos=True)
        again.prompt = list(r.prompt)
        alone = solo.run([again])[r.request_id]
        assert together[r.request_id].tokens == alone.tokens, r.request_id
        assert len(alone.tokens) == 12


def test_choice_with_max_tokens_1_finishes_grammar_completed(harness):
    """A one-token choice answer ends with GRAMMAR_COMPLETED at once (the grammar can only
    end), not LENGTH because max_tokens was reached."""
    compiler = xgr.GrammarCompiler(harness.vocab.tokenizer_info(), max_threads=1)
    # Single characters: each answer has exactly one tokenization, one token long.
    grammar = compiler.compile_grammar('root ::= "a" | "b" | "c"')
    for seed in range(4):
        out = harness.run([make(harness, f"one{seed}", seed=seed, max_tokens=1,
                                compiled=grammar)])[f"one{seed}"]
        assert out.reason == GRAMMAR_COMPLETED and text(harness, out) in ("a", "b", "c")


def test_json_answer_ends_the_step_its_grammar_closes(harness):
    """The request finishes with the token that closes the JSON object: no extra step to
    sample the end of sequence, and no end token in the output."""
    compiler = xgr.GrammarCompiler(harness.vocab.tokenizer_info(), max_threads=1)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    for seed in range(5):
        out = harness.run([make(harness, f"j{seed}", seed=seed, max_tokens=40,
                                compiled=grammar)])[f"j{seed}"]
        assert out.reason == GRAMMAR_COMPLETED
        assert json.loads(text(harness, out)) in ({"ok": True}, {"ok": False})
        assert text(harness, out).endswith("}")
        # Every output token is part of the text: the last one closed the object.
        assert harness.vocab.decode(out.tokens[:-1]) != text(harness, out)


def test_logprobs_are_of_the_sampled_distribution_and_change_no_token(harness, compiled):
    plain = harness.run([make(harness, "p", seed=5, temperature=0.0, max_tokens=12)])["p"]
    asked = harness.run([make(harness, "p", seed=5, temperature=0.0, max_tokens=12,
                              logprobs=True, top_logprobs=5)])["p"]
    assert asked.tokens == plain.tokens and len(asked.logprobs) == len(asked.tokens)
    for token, (lp, top_ids, top_lps) in zip(asked.tokens, asked.logprobs, strict=True):
        assert len(top_ids) == 5 and top_lps == sorted(top_lps, reverse=True)
        assert top_ids[0] == token and lp == pytest.approx(top_lps[0])  # greedy: the argmax
        assert all(v <= 0 for v in top_lps)
    bare = harness.run([make(harness, "b", seed=5, max_tokens=6, logprobs=True)])["b"]
    assert bare.logprobs and all(ids == [] and v == [] and lp <= 0
                                 for lp, ids, v in bare.logprobs)


def test_guided_logprobs_cover_only_tokens_the_grammar_allows(harness, compiled):
    mix = constraint_mix()
    i = next(i for i, (kind, _) in enumerate(mix) if kind == "choice")
    out = harness.run([make(harness, "c", seed=7, max_tokens=24, compiled=compiled[i],
                            logprobs=True, top_logprobs=20)])["c"]
    assert out.reason == GRAMMAR_COMPLETED and len(out.logprobs) == len(out.tokens)
    matcher = xgr.GrammarMatcher(compiled[i])
    for token, (lp, top_ids, top_lps) in zip(out.tokens, out.logprobs, strict=True):
        assert lp <= 0 and (token in top_ids or len(top_ids) == 20)
        for alt in top_ids:  # every alternative is a token the grammar allowed here
            assert matcher.accept_token(alt), alt
            matcher.rollback(1)
        assert sum(math.exp(v) for v in top_lps) <= 1 + 1e-4
        assert matcher.accept_token(token)


def _drain_until_done(h: EngineHarness, steps: int = 500) -> dict[str, list]:
    """Step a draining engine until it ends; each request's RowOutputs."""
    for _ in range(steps):
        if h.engine.drained.is_set():
            break
        h.engine.step()
    assert h.engine.drained.is_set(), "the drain did not end"
    out: dict[str, list] = {}
    for o in h._outputs:
        out.setdefault(o.req.request_id, []).append(o)
    return out


def test_drain_finishes_running_rows_starts_nothing_new_then_ends(model_dir):
    h = EngineHarness(model_dir, slots=2)
    h.table.allocate("running", make(h, "running", max_tokens=16, ignore_eos=True))
    h.engine.step()
    h.engine.step()
    h.engine.drain()
    # An admission that got in before the drain was seen: it never starts, it is dropped.
    late = h.table.allocate("late", make(h, "late", max_tokens=4))
    dropped = []
    late.on_drop = lambda entry, reason: dropped.append(reason)
    out = _drain_until_done(h)
    finish = out["running"][-1].finish
    assert finish.reason == LENGTH and sum(len(o.tokens) for o in out["running"]) == 16
    assert "late" not in out and dropped == ["shutdown"]
    assert h.table.in_use() == 0 and not h.engine.runs


def test_drain_timeout_fails_running_rows_with_unavailable(model_dir):
    h = EngineHarness(model_dir, slots=2)
    h.engine.cfg = dataclasses.replace(h.engine.cfg, drain_timeout_s=0.0)
    h.table.allocate("long", make(h, "long", max_tokens=200, ignore_eos=True))
    h.engine.step()
    h.engine.step()
    h.engine.drain()
    out = _drain_until_done(h, steps=2)  # the deadline passes at the next step
    finish = out["long"][-1].finish
    assert finish.reason == UNAVAILABLE and finish.code == 14, finish
    assert "drain timeout" in finish.message
    assert h.table.in_use() == 0 and not h.engine.runs



@pytest.mark.parametrize("regex, text, only_end", [
    ("ab", "ab", True),          # complete, nothing but a stop token may follow
    ("ab(c)?", "ab", False),     # complete, and "c" may follow
    ("abc", "ab", False),        # not complete
])
def test_the_can_only_end_check_reads_the_whole_mask_but_the_stop_ids(harness, regex, text,
                                                                       only_end):
    # A row whose grammar can only end now finishes without sampling the stop token. The
    # check reads the row's whole bitmask but the row's stop ids: the grammar's, and a stop
    # id of the request's own that the grammar allows ("c").
    compiler = xgr.GrammarCompiler(harness.vocab.tokenizer_info(), max_threads=1)
    grammar = compiler.compile_regex(regex)
    eos = frozenset(harness.vocab.eos_token_ids)
    (c,) = harness.vocab.encode("c", add_special_tokens=False)
    for stops in (eos, eos | {c}):
        matcher = xgr.GrammarMatcher(grammar)
        for token in harness.vocab.encode(text, add_special_tokens=False):
            assert matcher.accept_token(token)
        row = dataclasses.make_dataclass("R", ["req", "stops"])(
            dataclasses.make_dataclass("Q", ["matcher"])(matcher), stops)
        expected = only_end or (regex == "ab(c)?" and c in stops)
        assert harness.engine._can_only_end(row) is expected


def test_index_stage_gives_each_index_its_own_entries_until_the_next_start():
    """The staged indices of one sampling point never overlap (all are used together); past
    the buffer an index is made on its own; start() reuses the buffer from its beginning."""
    import torch

    stage = _IndexStage(8, torch.device("cpu"))
    stage.start()
    a, b = stage([3, 1, 2]), stage([7, 0, 5, 4])
    c = stage([6, 6])  # 9 entries > 8: made apart, the staged ones untouched
    assert a.tolist() == [3, 1, 2] and b.tolist() == [7, 0, 5, 4] and c.tolist() == [6, 6]
    assert c.dtype == torch.int64 and a.dtype == torch.int64
    stage.start()
    assert stage([9] * 8).tolist() == [9] * 8


def test_index_stage_blocks_keep_their_dtype_and_rows_beside_the_indices():
    """A sampling batch's columns staged beside the indices: float32 and int64 blocks of one
    sampling point stay intact together, and from_lists through the stage gives the batch
    built from fresh tensors, value for value."""
    import torch

    from gpu_worker.sampling.sampler import SamplingBatch

    stage = _IndexStage(16, torch.device("cpu"))
    stage.start()
    index = stage([4, 2])
    ints, floats = stage.blocks([[0, 5], [2**62, -3], [11, 0]],
                                [[0.7, 1.0], [0.9, 1.0], [0.0, 0.05]])  # one copy
    assert index.tolist() == [4, 2]
    assert floats.dtype == torch.float32 and floats.shape == (3, 2)
    assert floats.tolist() == torch.tensor([[0.7, 1.0], [0.9, 1.0], [0.0, 0.05]]).tolist()
    assert ints.tolist() == [[0, 5], [2**62, -3], [11, 0]]
    # 16 + 48 + 24 bytes taken of 12 * 16: 192 more bytes of floats do not fit, made apart
    big = stage.blocks([], [[1] * 8] * 6)[1]
    assert big.tolist() == [[1.0] * 8] * 6 and floats.tolist()[2] == [0.0, 0.05000000074505806]
    columns = ([0.0, 0.8, 1.3], [0, 4, 0], [1.0, 0.9, 1.0], [0.0, 0.0, 0.1], [7, 2**40, -1],
               [0, 17, 3])
    stage.start()
    staged = SamplingBatch.from_lists(*columns, stage=stage.blocks)
    fresh = SamplingBatch.from_lists(*columns)
    for name in ("temperature", "top_k", "top_p", "min_p", "seed", "step"):
        a, b = getattr(staged, name), getattr(fresh, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert staged.flags == fresh.flags


def test_an_idle_engine_backs_off_and_wakes_at_once(model_dir):
    """An idle engine waits longer for its table after each idle step (an idle TP group's
    control all-reduce costs every rank CPU), up to its cap; an Admit or a drain still wakes
    it at once, so the backoff adds no start latency."""
    h = EngineHarness(model_dir, slots=2)
    eng = h.engine
    eng.cfg = dataclasses.replace(eng.cfg, idle_poll_s=0.01, idle_poll_max_s=0.64)
    eng._idle_wait = eng.cfg.idle_poll_s
    waits = []
    for _ in range(7):
        eng.step()
        waits.append(eng._idle_wait)
    assert waits == [0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 0.64]
    req = make(h, "wake", max_tokens=2)
    timer = threading.Timer(0.02, lambda: h.table.allocate(req.request_id, req))
    t0 = time.monotonic()
    timer.start()
    eng.step()
    assert time.monotonic() - t0 < 0.4 and eng.runs  # it started, well before the 0.64 s wait
    assert eng._idle_wait == eng.cfg.idle_poll_s
    while eng.runs or eng._inflight is not None:
        eng.step()
    h._outputs.clear()
    for _ in range(7):
        eng.step()
    assert eng._idle_wait == 0.64
    timer = threading.Timer(0.02, eng.drain)
    t0 = time.monotonic()
    timer.start()
    eng.step()
    assert time.monotonic() - t0 < 0.4 and eng.drained.is_set()


def test_cpu_mask_kernel_gives_the_triton_kernels_tokens_at_48_slots(model_dir, compiled):
    # A CPU worker applies masks with xgrammar's C++ kernel (masks.apply_token_bitmask_cpu_);
    # the engine tests above run the Triton kernel. 96 guided and unguided requests through
    # 48 slots, greedy and seeded temperature, mask-first (no accept-first: every guided
    # token is sampled from masked logits): the same tokens either way.
    mix = constraint_mix()
    rng = random.Random(7)
    picks = [(n, rng.randrange(len(mix)), rng.choice([0.0, 0.8, 1.3])) for n in range(96)]
    outs = []
    for triton_masks in (True, False):
        h = EngineHarness(model_dir, slots=48, accept_first=False, triton_masks=triton_masks)
        outs.append(h.run([make(h, f"r{n}", prompt=f"item {n}", seed=n, max_tokens=40,
                                temperature=t, compiled=compiled.get(i))
                           for n, i, t in picks]))
    triton_out, cpu_out = outs
    for n, i, _ in picks:
        a, b = triton_out[f"r{n}"], cpu_out[f"r{n}"]
        assert (a.tokens, a.reason) == (b.tokens, b.reason), (n, mix[i][0])
    guided = [n for n, i, _ in picks if mix[i][0] != "none"]
    assert len(guided) > 48
    assert all(cpu_out[f"r{n}"].reason == GRAMMAR_COMPLETED for n in guided)
