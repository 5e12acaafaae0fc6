"""Compiles grammars in a pool of subprocesses, so a bad spec can only fail itself.

Real xgrammar versions have segfaulted, hung and exhausted memory on real-world schemas. Each
compile runs in a child process (the "spawn" context: never fork a process holding gRPC
threads) that holds both backends for the vocabulary (grammar_service.backends) and picks
one per spec (grammar_service.choice), under a per-compile deadline and an address-space cap (RLIMIT_AS, set in the child above its start-up size).
A child that crashes, runs past the deadline or hits the cap fails that one compile with a
clear error; the pool kills it and starts a replacement.

Test hook: when GRAMSERVE_COMPILE_TEST_HOOKS=1 is in a child's environment at start, the
regex specs starting `__gramserve_test_crash__`, `__gramserve_test_hang__` and
`__gramserve_test_memory__` make that child raise SIGSEGV, sleep forever, or allocate past its
cap. Without the variable they are ordinary regexes. Only the isolation tests set it.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import signal
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from grammar_service.backends import VocabView
from grammar_service.choice import Compiled
from grammar_service.compile_queue import FairQueue
from grammar_service.specs import CanonicalSpec
from protos.rpc import (
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)

log = logging.getLogger(__name__)

TEST_HOOKS_ENV = "GRAMSERVE_COMPILE_TEST_HOOKS"
_TEST_PREFIX = "__gramserve_test_"
_LONG_SPECS = 4096  # specs remembered as needing the general lane


class CompileInvalid(InvalidArgument):
    """The backend refused the spec (syntax error, unsupported feature), or options.strict
    refused the approximation."""

    reason = "invalid"


class CompileTimeout(DeadlineExceeded):
    """The compile ran past the per-compile deadline."""

    reason = "timeout"


class CompileMemory(ResourceExhausted):
    """The compile ran past the memory cap."""

    reason = "memory"


class CompileCrashed(ServiceError):
    """The compiling process died (INTERNAL): a compiler bug this spec triggers."""

    reason = "crash"


@dataclass
class _Lane:
    """Compile processes of one kind, their memory cap each, and the fair queue before them.
    `limit` bounds how many compile at once (the memory budget's share of the lane)."""

    name: str
    cap_mb: int
    limit: int
    idle: list = field(default_factory=list)
    running: int = 0
    queue: FairQueue = None

    def take(self):
        if self.running < self.limit and self.idle:
            self.running += 1
            return self.idle.pop()
        return None

    def give(self, child) -> None:
        self.running -= 1
        if child is not None:
            self.idle.append(child)


class _Demoted(Exception):
    """A short-lane compile ran past the short lane's time or memory: it goes to the general
    lane instead."""


class CompilePool:
    """Compile processes in two lanes, scheduled fairly, under one memory budget.

    vocab: the vocabulary's VocabView (both backends are built from it in each child).
    workers: general-lane processes (>= 1). timeout_s: per-compile deadline. memory_mb:
    address space a child may add to its start-up size (0: no cap). threads: xgrammar
    threads per compile. Processes start at construction (in the background); each is
    ready about 1-2 s later.

    Why two lanes: a few compile bombs (schemas that run to the deadline or the memory cap)
    used to hold every process for a minute while a one-property schema waited. Now small
    specs (at most `short_max_bytes` of text) have `short_workers` processes of their own,
    where a compile gets `short_seconds` under a cap of `short_memory_mb`; a small spec that
    needs more is cut off there and compiled in the general lane, and is remembered, so it
    goes there directly next time (a warm spare process takes the short lane's place at
    once: starting one loads the vocabulary, seconds). Larger specs use the general lane
    only. So a small compile waits at most for another small one, whatever the general lane
    holds. In each lane the queue is fair between clients, smallest spec first, and a
    compile's own deadline is respected while it waits (grammar_service.compile_queue).

    memory_budget_mb bounds the sum of the caps of the compiles running at once (0: every
    process at its cap, workers * memory_mb + short_workers * short_memory_mb): the general
    lane runs only as many compiles as the budget leaves room for (at least one).
    """

    def __init__(self, vocab: VocabView, *, workers: int = 2, timeout_s: float = 30.0,
                 memory_mb: int = 2048, threads: int = 1, startup_timeout_s: float = 120.0,
                 short_workers: int = 1, short_seconds: float = 1.0,
                 short_memory_mb: int = 1024, memory_budget_mb: int = 0,
                 short_max_bytes: int = 4096):
        if workers < 1:
            raise ValueError("workers must be >= 1")
        if short_workers < 0 or short_seconds <= 0 or short_memory_mb < 0:
            raise ValueError("short_workers must be >= 0, short_seconds and short_memory_mb > 0")
        self._vocab, self._threads = vocab, threads
        self._timeout_s = timeout_s
        self._startup_timeout_s = startup_timeout_s
        self._short_seconds = short_seconds
        self._short_max_bytes = short_max_bytes
        self._ctx = multiprocessing.get_context("spawn")
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._long: OrderedDict[str, None] = OrderedDict()  # specs that needed the general lane
        short_cap = min(short_memory_mb, memory_mb) if memory_mb else short_memory_mb
        general_limit = workers
        if memory_mb and memory_budget_mb:
            left = memory_budget_mb - short_workers * short_cap
            general_limit = max(1, min(workers, left // memory_mb))
        self.memory_budget_mb = memory_budget_mb or (
            workers * memory_mb + short_workers * short_cap if memory_mb else 0)
        self._general = self._lane("general", memory_mb, workers, general_limit)
        self._short = self._lane("short", short_cap, short_workers, short_workers) \
            if short_workers else None
        self._spare = self._child(short_cap) if short_workers else None
        self.workers = workers

    def _child(self, cap_mb: int) -> _Child:
        return _Child(self._ctx, (self._vocab, self._threads, cap_mb))

    def _lane(self, name: str, cap_mb: int, processes: int, limit: int) -> _Lane:
        lane = _Lane(name, cap_mb, limit)
        lane.idle = [self._child(cap_mb) for _ in range(processes)]
        lane.queue = FairQueue(lane.take, lane.give)
        return lane

    def compile(self, spec: CanonicalSpec, *, field: str = "spec", client: str = "",
                deadline: float | None = None) -> Compiled:
        """Compile `spec` in a child with the backend grammar_service.choice picks.

        `client` is the caller's identity (fairness between clients); `deadline` a
        time.monotonic() value after which the caller no longer wants the result (the
        compile stops waiting, or running, then). Raises CompileInvalid (INVALID_ARGUMENT,
        naming `field`.kind), CompileTimeout, CompileMemory, CompileCrashed,
        DeadlineExceeded (its deadline passed while it waited), or Unavailable when the
        pool is closed or a child cannot start. A failed child is replaced before the next
        compile uses its place.
        """
        if self._closed.is_set():
            raise Unavailable("the compile pool is shut down")
        name = f"{field}.{spec.kind}"
        key = json.dumps(spec.to_dict(), sort_keys=True)
        with self._lock:
            known_long = key in self._long
        if self._short is not None and not known_long and \
                len(spec.text.encode()) <= self._short_max_bytes:
            try:
                return self._run(self._short, spec, name, client, deadline)
            except _Demoted:
                with self._lock:
                    self._long[key] = None
                    while len(self._long) > _LONG_SPECS:
                        self._long.popitem(last=False)
        return self._run(self._general, spec, name, client, deadline)

    def _run(self, lane: _Lane, spec: CanonicalSpec, name: str, client: str,
             deadline: float | None) -> Compiled:
        child = lane.queue.acquire(client, len(spec.text), deadline)
        short = lane is self._short
        limit = self._short_seconds if short else self._timeout_s
        if deadline is not None:
            limit = min(limit, deadline - time.monotonic())
        try:
            if limit <= 0:
                raise DeadlineExceeded("the compile's deadline passed before it started",
                                       field=name)
            return child.run(spec, limit, self._startup_timeout_s, name)
        except CompileMemory:
            if short and lane.cap_mb < self._general.cap_mb:
                raise _Demoted() from None  # the process is fine: it caught MemoryError
            child.kill()
            child = self._replacement(lane)
            raise
        except (CompileTimeout, CompileCrashed, Unavailable) as exc:
            child.kill()
            child = self._replacement(lane)
            if short and isinstance(exc, CompileTimeout) and limit >= self._short_seconds:
                raise _Demoted() from None
            raise
        finally:
            if self._closed.is_set() and child is not None:
                child.kill()
                child = None
            lane.queue.release(child)

    def _replacement(self, lane: _Lane) -> _Child | None:
        """The short lane's warm spare, else None; a new process (for the spare's place or
        the lane) starts on a thread of its own: starting one blocks its caller until the
        new interpreter has read its arguments, seconds on a busy machine."""
        with self._lock:
            spare = self._spare if lane is self._short else None
            if spare is not None:
                self._spare = None
        threading.Thread(target=self._start_child, args=(lane, spare is not None),
                         daemon=True, name="compile-spawn").start()
        return spare

    def _start_child(self, lane: _Lane, as_spare: bool) -> None:
        child = self._child(lane.cap_mb)
        if self._closed.is_set():
            child.kill()
            return
        if as_spare:
            with self._lock:
                if self._spare is None:
                    self._spare, child = child, None
            if child is not None:
                child.kill()
            return
        lane.queue.update(lambda: lane.idle.append(child))
        if self._closed.is_set():  # closed meanwhile: close() may have missed this one
            with lane.queue._cond:
                if child in lane.idle:
                    lane.idle.remove(child)
                    child.kill()

    def close(self) -> None:
        """Stop every idle child; busy ones stop when their compile returns. Idempotent."""
        self._closed.set()
        for lane in (self._general, self._short):
            if lane is None:
                continue
            lane.queue.close()
            with lane.queue._cond:
                idle, lane.idle = lane.idle, []
            for child in idle:
                child.kill()
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.kill()


class _Child:
    """One compile process and the parent's end of its pipe."""

    def __init__(self, ctx, args):
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_child_main, args=(child_conn, *args), daemon=True)
        self.proc.start()
        child_conn.close()
        self.ready = False

    def run(self, spec: CanonicalSpec, timeout_s: float, startup_s: float,
            field: str) -> Compiled:
        if not self.ready:
            self._receive(startup_s, field, starting=True)
            self.ready = True
        self.conn.send(spec.to_dict())
        return self._receive(timeout_s, field, starting=False)

    def _receive(self, timeout_s: float, field: str, *, starting: bool):
        if not self.conn.poll(timeout_s):
            if starting:
                raise Unavailable(f"a compile process did not start within {timeout_s:g} s")
            raise CompileTimeout(f"the compile ran past the deadline of {timeout_s:g} s",
                                 field=field)
        try:
            status, payload = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(timeout=5)
            raise CompileCrashed(f"the compile process crashed ({_describe_exit(self.proc)}); "
                                 "this spec triggers a compiler bug", field=field) from None
        if status in ("ok", "ready"):
            return payload
        if status == "memory":
            raise CompileMemory(f"the compile ran past the memory cap: {payload}", field=field)
        if status == "invalid":
            raise CompileInvalid(payload, field=field)
        raise Unavailable(f"a compile process failed to start: {payload}")

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


def _describe_exit(proc) -> str:
    code = proc.exitcode
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


# ---- everything below runs in the child process ----

_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _child_main(conn, vocab: VocabView, threads: int, memory_mb: int) -> None:
    try:
        from grammar_service.choice import StrictRefused, compile_spec

        backends = vocab.backends(threads)
        if memory_mb > 0:
            _cap_address_space(memory_mb)
    except Exception as exc:  # reported to the parent, which fails the compile
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    hooks = os.environ.get(TEST_HOOKS_ENV) == "1"
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        spec = CanonicalSpec.from_dict(job)
        try:
            if hooks and spec.kind == "regex" and spec.text.startswith(_TEST_PREFIX):
                _run_test_hook(spec.text, memory_mb)
            conn.send(("ok", compile_spec(spec, backends)))
        except StrictRefused as exc:
            conn.send(("invalid", str(exc)))
        except MemoryError as exc:
            conn.send(("memory", str(exc) or "out of memory"))
        except Exception as exc:
            message = _XGR_PREFIX.sub("", str(exc).strip())
            if "bad_alloc" in message:
                conn.send(("memory", message))
            else:
                name = getattr(exc, "backend", "") or "the backend"
                conn.send(("invalid", f"{name} cannot compile it: {message}"))


def _cap_address_space(memory_mb: int) -> None:
    import resource

    with open("/proc/self/status") as f:
        vm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    limit = vm_kb * 1024 + memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _run_test_hook(name: str, memory_mb: int) -> None:
    import time

    if name.startswith("__gramserve_test_crash__"):
        os.kill(os.getpid(), signal.SIGSEGV)
    elif name.startswith("__gramserve_test_hang__"):
        time.sleep(3600)
    elif name.startswith("__gramserve_test_memory__"):
        # A real allocation past the real cap: proves RLIMIT_AS is in force.
        bytearray((memory_mb + 64) * 1024 * 1024)
