"""Compile bombs do not hold up small compiles (grammar_service/compile_pool.py), with real
compile processes: the test hooks stand for bombs (a compile that hangs to its deadline, one
that allocates past its cap), since a real schema that does either depends on the xgrammar
version; the scheduling under test is the real one."""

import threading
import time

import pytest

from grammar_service.backends import VocabView
from grammar_service.compile_pool import TEST_HOOKS_ENV, CompileMemory, CompilePool
from grammar_service.default_model import ensure_default_model
from grammar_service.specs import CanonicalSpec, GrammarOptions
from grammar_service.vocab import load_vocab
from protos.rpc import DeadlineExceeded, ServiceError


@pytest.fixture(scope="module")
def view():
    return VocabView.of(load_vocab(ensure_default_model()))


@pytest.fixture
def hooks(monkeypatch):
    monkeypatch.setenv(TEST_HOOKS_ENV, "1")  # in the environment of every child spawned


def regex(text: str) -> CanonicalSpec:
    return CanonicalSpec("regex", text, GrammarOptions())


def large_bomb(name: str) -> str:
    """A hanging compile whose spec is too large for the short lane (a padded regex)."""
    return f"__gramserve_test_hang__{name}" + "x" * 5000


def _bomb(pool, name: str, errors: list) -> threading.Thread:
    def run():
        try:
            pool.compile(regex(large_bomb(name)), client="bomber")
        except ServiceError as exc:
            errors.append(exc)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _warm(pool, n: int = 2) -> None:
    for i in range(n):  # every process of both lanes has started
        pool.compile(regex(f"warm-{i}[a-z]"))


def test_small_compiles_are_served_at_once_while_compile_bombs_run(view, hooks):
    # Two general processes, but the memory budget leaves room for one 256 MB cap beside the
    # short lane's 128 MB: one long compile runs at a time, the others wait.
    pool = CompilePool(view, workers=2, timeout_s=8.0, memory_mb=256, short_workers=1,
                       short_seconds=1.0, short_memory_mb=128, memory_budget_mb=450)
    try:
        _warm(pool)
        # A small memory bomb is cut short at the short lane's cap, then fails at the
        # general lane's.
        with pytest.raises(CompileMemory):
            pool.compile(regex("__gramserve_test_memory__"), client="m")
        errors: list = []
        bombs = [_bomb(pool, str(i), errors) for i in range(4)]
        time.sleep(1.0)  # one bomb runs in the general lane, three wait
        for i, spec in enumerate([regex("fresh-[0-9]+"), CanonicalSpec(
                "json_schema", '{"type":"object","properties":{"a":{"type":"integer"}}}',
                GrammarOptions())]):
            t0 = time.monotonic()
            compiled = pool.compile(spec, client=f"small-{i}")
            assert compiled.payload and time.monotonic() - t0 < 2.0, time.monotonic() - t0
        # A compile that must take the general lane waits there no longer than its deadline
        # (the budget keeps the second general process idle).
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="waited .* for a compile process"):
            pool.compile(regex(large_bomb("late")), client="late",
                         deadline=time.monotonic() + 1.0)
        assert time.monotonic() - t0 < 2.5
        # A small spec that runs long is cut short and remembered: it then takes the general
        # lane directly (where it waits behind the bombs until its deadline).
        with pytest.raises(DeadlineExceeded):
            pool.compile(regex("__gramserve_test_hang__small"), client="sly",
                         deadline=time.monotonic() + 3.0)
        with pytest.raises(DeadlineExceeded, match="waited .* for a compile process"):
            pool.compile(regex("__gramserve_test_hang__small"), client="sly",
                         deadline=time.monotonic() + 0.5)
        t0 = time.monotonic()  # the short lane still serves at once (the spare took over)
        assert pool.compile(regex("after-[0-9]+"), client="small-2").payload
        assert time.monotonic() - t0 < 2.0
    finally:
        pool.close()
    for t in bombs:  # the running one ends at its deadline, the queued ones at close
        t.join(30)
    assert sorted(type(e).__name__ for e in errors) == ["CompileTimeout"] + ["Unavailable"] * 3
