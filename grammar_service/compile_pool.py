"""Compiles grammars in a pool of subprocesses, so a bad spec can only fail itself.

Real xgrammar versions have segfaulted, hung and exhausted memory on real-world schemas. Each
compile runs in a child process (the "spawn" context: never fork a process holding gRPC
threads) that holds both backends for the vocabulary (grammar_service.backends) and picks
one per spec (grammar_service.choice), under a per-compile deadline and an address-space cap (RLIMIT_AS, set in the child above its start-up size).
A child that crashes, runs past the deadline or hits the cap fails that one compile with a
clear error; the pool kills it and starts a replacement.

Test hook: when GRAMSERVE_COMPILE_TEST_HOOKS=1 is in a child's environment at start, the
regex specs `__gramserve_test_crash__`, `__gramserve_test_hang__` and
`__gramserve_test_memory__` make that child raise SIGSEGV, sleep forever, or allocate past its
cap. Without the variable they are ordinary regexes. Only the isolation tests set it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import re
import signal
import threading

from grammar_service.backends import VocabView
from grammar_service.choice import Compiled
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


class CompilePool:
    """A fixed number of compile processes; `compile` blocks until one is free.

    vocab: the vocabulary's VocabView (both backends are built from it in each child).
    workers: processes (>= 1). timeout_s: per-compile deadline. memory_mb: address space a
    child may add to its start-up size (0: no cap). threads: xgrammar threads per compile.
    Processes start at construction (in the background); each is ready about 1-2 s later.
    """

    def __init__(self, vocab: VocabView, *, workers: int = 2, timeout_s: float = 30.0,
                 memory_mb: int = 2048, threads: int = 1, startup_timeout_s: float = 120.0):
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self._args = (vocab, threads, memory_mb)
        self._timeout_s = timeout_s
        self._startup_timeout_s = startup_timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self._idle: queue.Queue[_Child] = queue.Queue()
        self._closed = threading.Event()
        for _ in range(workers):
            self._idle.put(_Child(self._ctx, self._args))
        self.workers = workers

    def compile(self, spec: CanonicalSpec, *, field: str = "spec") -> Compiled:
        """Compile `spec` in a child with the backend grammar_service.choice picks.

        Raises CompileInvalid (INVALID_ARGUMENT, naming `field`.kind), CompileTimeout,
        CompileMemory, CompileCrashed, or Unavailable when the pool is closed or a child
        cannot start. A failed child is replaced before the next compile uses its place.
        """
        if self._closed.is_set():
            raise Unavailable("the compile pool is shut down")
        child = self._idle.get()
        try:
            return child.run(spec, self._timeout_s, self._startup_timeout_s,
                             f"{field}.{spec.kind}")
        except (CompileTimeout, CompileMemory, CompileCrashed, Unavailable):
            child.kill()
            child = _Child(self._ctx, self._args)
            raise
        finally:
            if self._closed.is_set():
                child.kill()
            else:
                self._idle.put(child)

    def close(self) -> None:
        """Stop every idle child; busy ones stop when their compile returns. Idempotent."""
        self._closed.set()
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return


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

    if name == "__gramserve_test_crash__":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif name == "__gramserve_test_hang__":
        time.sleep(3600)
    elif name == "__gramserve_test_memory__":
        # A real allocation past the real cap: proves RLIMIT_AS is in force.
        bytearray((memory_mb + 64) * 1024 * 1024)
