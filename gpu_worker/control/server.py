"""One rank's engine process: builds the rank and serves its gRPC front's requests.

`serve(cfg)` builds the rank (distributed groups, model, slot table, grammar cache, engine)
and starts its gRPC front, a process of its own (`gpu_worker.control.front`: the Worker
service; this module's `FrontLink` is the engine's end of the socket between them);
`main(argv)` is `gramserve worker`. SIGTERM drains the rank's whole group
(gpu_worker/control/engine.py): every rank reports NOT_SERVING and refuses admissions with
UNAVAILABLE (the gateway admits the request on another group), running requests finish for
up to --drain-timeout seconds, then every rank exits 0.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection

import grpc
import torch
from prometheus_client import CollectorRegistry

from gpu_worker.config import WorkerConfig, cuda_device_index, draft_tokens_on
from gpu_worker.control import engine as eng
from gpu_worker.control.lockstep import ControlChannel
from gpu_worker.control.slots import Entry, NoFreeSlot, SlotBusy, SlotTable, UnknownRequest
from gpu_worker.guided.grammar_cache import WorkerGrammarCache
from gpu_worker.metrics import WorkerMetrics
from gpu_worker.runtime.loader import load_model
from gpu_worker.runtime.parallel import init_distributed
from grammar_service.default_model import resolve_model
from grammar_service.vocab import Vocab, load_vocab
from protos import common_pb2, worker_pb2
from protos.rpc import (
    ConstantLabels,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
    Unavailable,
    register_build_info,
    start_metrics_server,
)
from protos.sampling import Sampling

log = logging.getLogger(__name__)

_FRONT_START_S = 60.0  # the front imports grpc and binds its port: well under a second
_FINISH = {
    eng.STOP: common_pb2.FINISH_REASON_STOP,
    eng.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    eng.GRAMMAR_COMPLETED: common_pb2.FINISH_REASON_GRAMMAR_COMPLETED,
    eng.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
    eng.DEAD_END: common_pb2.FINISH_REASON_ERROR_DEAD_END,
    eng.DIVERGENCE: common_pb2.FINISH_REASON_ERROR_DIVERGENCE,
    eng.INTERNAL: common_pb2.FINISH_REASON_ERROR_INTERNAL,
}
_SLOT_STATE = {"free": worker_pb2.SLOT_STATE_FREE, "pending": worker_pb2.SLOT_STATE_PENDING}


def request_from_proto(msg: worker_pb2.AdmitRequest, vocab: Vocab, max_model_len: int) -> eng.Request:
    """Validate an Admit; InvalidArgument names the bad field."""
    if not msg.request_id or len(msg.request_id) > 256:
        raise InvalidArgument("must be 1 to 256 characters", field="request_id")
    prompt = list(msg.prompt_token_ids)
    if not prompt:
        raise InvalidArgument("must not be empty", field="prompt_token_ids")
    if len(prompt) >= max_model_len:
        raise InvalidArgument(f"{len(prompt)} tokens leave no room for output within "
                              f"max-model-len {max_model_len}", field="prompt_token_ids")
    bad = next((t for t in prompt if t >= vocab.vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"token id {bad} is outside the vocabulary ({vocab.vocab_size})",
                              field="prompt_token_ids")
    s = Sampling.from_proto(msg.sampling, vocab_size=vocab.model_vocab_size)
    return eng.Request(
        request_id=msg.request_id, prompt=prompt, max_tokens=s.max_tokens,
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
        seed=s.seed_int64, stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens, logprobs=s.logprobs, top_logprobs=s.top_logprobs,
        logprobs_mode=s.logprobs_mode)


@dataclass
class Rank:
    """Everything one rank process holds."""

    cfg: WorkerConfig
    model_dir: object
    vocab: Vocab
    device: torch.device
    dtype: torch.dtype
    table: SlotTable
    grammars: WorkerGrammarCache
    engine: eng.Engine
    metrics: WorkerMetrics
    admit_pool: ThreadPoolExecutor
    serving: bool = True
    link: FrontLink | None = None  # to the gRPC front, once it started

    @property
    def draining(self) -> bool:
        """This rank was told to drain, or its group drains."""
        return self.engine.drain_requested or self.engine.draining

    def admit(self, msg: worker_pb2.AdmitRequest, session: int) -> Entry:
        """Validate an Admit from the front's `session`, pin its grammar, build this rank's
        own matcher (I1) and claim the slot (rank 0 allocates; other ranks register rank 0's
        choice). Raises ServiceError; on failure nothing is held."""
        if not self.serving:
            raise Unavailable("this worker rank lost its group and is shutting down")
        if self.draining:
            # Any rank refusing keeps the request from starting anywhere (the lockstep
            # starts a slot only once every rank holds its Admit).
            raise Unavailable("this worker group is draining (shutting down); admit the "
                              "request on another group")
        req = request_from_proto(msg, self.vocab, self.cfg.max_model_len)
        req.tag = msg.tag
        if msg.grammar_key:
            handle = self.grammars.acquire(msg.grammar_key,
                                           msg.grammar if msg.HasField("grammar") else None,
                                           backend=msg.grammar_backend or None)
            req.grammar, req.release_grammar = handle, self.grammars.release
        try:
            if req.grammar is not None:
                req.matcher = req.grammar.new_matcher()  # this rank's own (I1)
            if self.cfg.rank == 0:
                if msg.slot != -1:
                    raise FailedPrecondition("rank 0 allocates slots: send slot = -1", field="slot")
                req.session = session
                try:
                    return self.table.allocate(req.request_id, req, on_drop=self._dropped)
                except NoFreeSlot as exc:
                    raise ResourceExhausted(str(exc)) from None
            try:
                return self.table.register(msg.slot, req.request_id, req, on_drop=self._dropped)
            except IndexError as exc:
                raise InvalidArgument(str(exc), field="slot") from None
            except (SlotBusy, UnknownRequest) as exc:
                raise FailedPrecondition(str(exc), field="slot") from None
        except BaseException:
            req.close()
            raise

    def _dropped(self, entry: Entry, reason: str) -> None:
        """A pending Admit left the table without starting: free its grammar, tell its
        session (rank 0)."""
        req = entry.payload
        req.close()
        if req.session is not None and self.link is not None:
            self.link.dropped(req, reason)

    def info(self) -> worker_pb2.WorkerInfo:
        slots = []
        runs = dict(self.engine.runs)
        for i, (state, entry) in enumerate(self.table.snapshot()):
            info = worker_pb2.SlotInfo(slot=i, state=_SLOT_STATE.get(state, 0))
            if entry is not None:
                info.request_id = entry.request_id
                info.guided = entry.payload.matcher is not None
            run = runs.get(i)
            if state == "running" and run is not None:
                prefill = run.prefilled < len(run.req.prompt)
                info.state = worker_pb2.SLOT_STATE_PREFILL if prefill else worker_pb2.SLOT_STATE_DECODE
                info.context_tokens = run.kv_len
            elif state == "running":
                info.state = worker_pb2.SLOT_STATE_PREFILL
            slots.append(info)
        cfg = self.cfg
        return worker_pb2.WorkerInfo(
            rank=cfg.rank, tp_size=cfg.tp, num_slots=cfg.slots,
            max_model_len=cfg.max_model_len, model=str(self.model_dir),
            vocab_fingerprint=self.vocab.fingerprint, vocab_size=self.vocab.vocab_size,
            model_vocab_size=self.vocab.model_vocab_size, slots=slots, device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            serving=self.serving and not self.draining)


def _finish_tuple(finish: eng.Finish, prompt_tokens: int) -> tuple:
    """A Finish as the front builds its proto (`front.finished_proto`)."""
    return (_FINISH.get(finish.reason, common_pb2.FINISH_REASON_ERROR_INTERNAL), finish.message,
            finish.code, finish.completion_tokens, finish.start_seconds,
            finish.first_token_seconds, prompt_tokens)


class FrontLink:
    """The engine process's end of the socket to the rank's gRPC front
    (`gpu_worker.control.front`, which says why the front is a process of its own).

    One reader thread serves the front's messages: admissions go to the rank's admit pool (a
    grammar fetch can take seconds), releases to the slot table. `live` holds, per open
    session, the entries it admitted and has not released yet ((slot, request id) -> Entry:
    a gateway releases every request it admitted, on every rank, once it ends), so that a
    vanished gateway's requests are released. The engine thread calls `publish` once per step
    (rank 0).
    """

    def __init__(self, rank: Rank, conn: Connection, proc: subprocess.Popen):
        self.rank = rank
        self.conn = conn
        self.proc = proc
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self.live: dict[int, dict[tuple[int, str], Entry]] = {}
        self.stopping = False
        self.on_lost: Callable[[], None] | None = None

    @classmethod
    def start(cls, rank: Rank) -> tuple[FrontLink, int]:
        """Start the front process, have it bind the rank's port; return (link, port)."""
        cfg = rank.cfg
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen([sys.executable, "-m", "gpu_worker.control.front",
                                 str(theirs.fileno())], pass_fds=[theirs.fileno()])
        theirs.close()
        conn = Connection(ours.detach())
        conn.send({"host": cfg.host, "port": cfg.port, "tls": _tls_pair(cfg),
                   "tls_client_ca": (open(cfg.tls_client_ca, "rb").read()
                                     if cfg.tls_client_ca else None),
                   "reflection": cfg.reflection == "on",
                   "log_level": logging.getLogger().getEffectiveLevel()})
        if not conn.poll(_FRONT_START_S):
            proc.kill()
            raise RuntimeError(f"the rank's gRPC front did not start in {_FRONT_START_S:g} s")
        try:
            kind, value = conn.recv()
        except EOFError:
            raise RuntimeError(f"the rank's gRPC front exited with status {proc.wait()}") from None
        if kind != "bound":
            proc.wait()
            raise RuntimeError(value)
        link = cls(rank, conn, proc)
        threading.Thread(target=link._read, daemon=True, name="front-reader").start()
        return link, value

    def send(self, msg: tuple) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def publish(self, outputs: list[eng.RowOutput]) -> None:
        """Engine thread: every session's rows of this step, in one message to the front."""
        rows = []
        for out in outputs:
            req = out.req
            if req.session is None:
                continue
            finish = out.finish
            if finish is not None:
                finish = _finish_tuple(finish, len(req.prompt))
            rows.append((req.session, req.tag, out.tokens, out.logprobs or None, finish))
        if rows:
            self.send(("step", self.rank.engine.step_index, rows))

    def dropped(self, req: eng.Request, reason: str) -> None:
        """A pending request left the table without starting (rank 0): tell its session."""
        if reason == "released":
            finish = eng.Finish(eng.CANCELLED, "released before it started")
        else:
            finish = eng.Finish(eng.UNAVAILABLE, f"request was not started on every rank: {reason}",
                                code=grpc.StatusCode.UNAVAILABLE.value[0])
        self.send(("step", 0, [(req.session, req.tag, [], None,
                                _finish_tuple(finish, len(req.prompt)))]))

    def health(self, serving: bool, sessions: bool = True) -> None:
        self.send(("health", serving, sessions))

    def stop(self, grace: float) -> None:
        """Have the front stop its server (streams get `grace` seconds) and wait for it."""
        self.stopping = True
        try:
            self.send(("stop", grace))
        except OSError:
            pass
        try:
            self.proc.wait(grace + 2.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._serve(msg)
            except Exception:  # a bug: this message fails, the rank goes on
                log.exception("front message %r failed", msg[0])
        if not self.stopping:
            log.error("the rank's gRPC front exited (status %s)", self.proc.poll())
            if self.on_lost is not None:
                self.on_lost()

    def _serve(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "admit":
            self.rank.admit_pool.submit(self._admit, msg[1], msg[2])
        elif kind == "release":
            _, slot, request_id, call_id = msg
            self._release(slot, request_id, call_id)
        elif kind == "open":
            with self._lock:
                self.live[msg[1]] = {}
        elif kind == "close":
            self._close(msg[1])
        elif kind == "info":
            self.send(("reply", msg[1], self.rank.info().SerializeToString()))

    def _release(self, slot: int, request_id: str, call_id: int) -> None:
        try:
            reply = ("ok", self.rank.table.request_release(slot, request_id))
        except IndexError as exc:
            reply = ("slot", str(exc))
        except UnknownRequest as exc:
            reply = ("unknown", str(exc))
        with self._lock:  # the gateway is done with it: its session stops holding it
            for live in self.live.values():
                if live.pop((slot, request_id), None) is not None:
                    break
        if call_id:
            self.send(("reply", call_id, reply))

    def _close(self, sid: int) -> None:
        """The session's stream ended: release every request it still holds."""
        with self._lock:
            live = self.live.pop(sid, {})
        for entry in live.values():
            try:
                self.rank.table.request_release(entry.slot, entry.request_id)
            except (IndexError, UnknownRequest):
                pass

    def _admit(self, sid: int, data: bytes) -> None:
        r = self.rank
        msg = worker_pb2.AdmitRequest.FromString(data)
        try:
            entry = r.admit(msg, sid)
        except ServiceError as exc:
            self.send(("admitted", sid, msg.tag, exc.code.value[0], str(exc), 0, r.cfg.rank))
            return
        except Exception as exc:  # a bug: the request fails, the rank goes on
            log.exception("admit failed")
            self.send(("admitted", sid, msg.tag, grpc.StatusCode.INTERNAL.value[0],
                       f"internal error: {type(exc).__name__}", 0, r.cfg.rank))
            return
        with self._lock:
            live = self.live.get(sid)
            if live is not None:
                live[entry.slot, entry.request_id] = entry
        if live is None:  # the gateway left while this admission ran
            try:
                r.table.request_release(entry.slot, entry.request_id)
            except (IndexError, UnknownRequest):
                pass
            return
        self.send(("admitted", sid, msg.tag, 0, "", entry.slot, r.cfg.rank))


def _device_and_dtype(cfg: WorkerConfig) -> tuple[torch.device, torch.dtype]:
    kind = cfg.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible")
        device = torch.device("cuda", cuda_device_index(cfg.rank, cfg.tp, cfg.gpu_offset,
                                                        torch.cuda.device_count()))
    else:
        device = torch.device("cpu")
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dtype = names.get(cfg.dtype, torch.bfloat16 if kind == "cuda" else torch.float32)
    return device, dtype


def _tls_pair(cfg: WorkerConfig) -> tuple[bytes, bytes] | None:
    """This rank's (certificate chain, key) PEM: served, and presented to the grammar service."""
    if not cfg.tls_cert:
        return None
    with open(cfg.tls_cert, "rb") as c, open(cfg.tls_key, "rb") as k:
        return c.read(), k.read()


def build_rank(cfg: WorkerConfig, registry: CollectorRegistry) -> Rank:
    """Join the group, load the shard and start the engine (not the gRPC server)."""
    device, dtype = _device_and_dtype(cfg)
    if device.type == "cpu":
        torch.set_num_threads(cfg.torch_threads or max(1, (os.cpu_count() or 1) // cfg.tp))
    model_dir = resolve_model(cfg.model or None)
    vocab = load_vocab(model_dir)
    tp, control_group = init_distributed(cfg.rank, cfg.tp, cfg.dist_addr, device,
                                         cfg.collective_timeout_s)
    model = load_model(model_dir, tp, dtype, device)
    model.allocate_kv_cache(cfg.slots + 1, cfg.max_model_len)  # + the CUDA graphs' scratch slot
    metrics = WorkerMetrics(registry)
    table = SlotTable(cfg.slots, is_rank0=cfg.rank == 0, admit_timeout_s=cfg.admit_timeout_s,
                      on_expire=metrics.admit_expired.inc)
    tls_ca = open(cfg.tls_ca, "rb").read() if cfg.tls_ca else None
    grammars = WorkerGrammarCache(cfg.grammar_service, vocab, cfg.grammar_cache_bytes,
                                  metrics=metrics, fetch_timeout_s=cfg.grammar_fetch_timeout_s,
                                  tls_ca=tls_ca, tls_identity=_tls_pair(cfg),
                                  fill_threads=cfg.mask_fill_threads or None)
    engine = eng.Engine(
        eng.EngineConfig(num_slots=cfg.slots, max_model_len=cfg.max_model_len,
                         step_tokens=cfg.step_tokens,
                         divergence_check_every=cfg.divergence_check_every,
                         cuda_graph_max_tokens=cfg.cuda_graph_max_tokens,
                         mask_fill_threads=cfg.mask_fill_threads,
                         forced_tokens=cfg.forced_tokens, accept_first=cfg.accept_first,
                         forced_round_cost=cfg.forced_round_cost,
                         draft_tokens=draft_tokens_on(cfg.draft_tokens, device.type),
                         fused_sampling={"on": True, "off": False}.get(cfg.fused_sampling),
                         drain_timeout_s=cfg.drain_timeout_s),
        model, table, ControlChannel(control_group, cfg.tp),
        vocab_size=vocab.vocab_size, model_vocab_size=model.config.vocab_size,
        eos_token_ids=vocab.eos_token_ids, device=device, metrics=metrics)
    # Admissions run off the session reader (a grammar fetch can take seconds); the pool is
    # sized for concurrent fetches, not for the slot count.
    rank = Rank(cfg, model_dir, vocab, device, dtype, table, grammars, engine, metrics,
                ThreadPoolExecutor(8, thread_name_prefix="admit"))
    return rank


def serve(cfg: WorkerConfig, registry: CollectorRegistry | None = None):
    """Start the rank, its gRPC front process and its engine; return (port, rank). Blocks
    until the group is formed (every rank must be started)."""
    registry = registry or CollectorRegistry()
    rank = build_rank(cfg, registry)
    link, port = FrontLink.start(rank)
    rank.link = link
    if cfg.rank == 0:
        rank.engine.publish = link.publish

    def on_fatal(exc: BaseException | None) -> None:
        # A rank without its peers (or its front) can do nothing useful: say so, let streams
        # carry the error out, then exit so that a supervisor restarts the whole group.
        rank.serving = False
        try:
            link.health(False, sessions=False)
        except OSError:
            pass

        def die():
            time.sleep(1.0)
            link.stop(0.5)
            os._exit(3)

        threading.Thread(target=die, daemon=True).start()

    def on_drain() -> None:
        # Out of the gateways' rotation at their next health check; admissions are refused
        # meanwhile (Rank.admit), which they retry on another group.
        link.health(False)
        rank.metrics.draining.set(1)

    rank.engine.on_fatal = on_fatal
    rank.engine.on_drain = on_drain
    link.on_lost = lambda: on_fatal(None)
    rank.engine.start()
    register_build_info(registry, "worker", torch=torch.__version__,
                        xgrammar=importlib.metadata.version("xgrammar"))
    start_metrics_server(cfg.metrics_port, ConstantLabels(registry, rank=str(cfg.rank)),
                         host=cfg.metrics_host)
    log.info("worker rank %d/%d serving on %s:%d (model %s, %s, %d slots)", cfg.rank, cfg.tp,
             cfg.host, port, rank.model_dir, rank.device, cfg.slots)
    return port, rank


def main(argv: list[str] | None = None) -> int:
    """`gramserve worker`: run one rank until SIGTERM/SIGINT."""
    logging.basicConfig(level=os.environ.get("GRAMSERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = WorkerConfig.from_args(argv)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    _, rank = serve(cfg)
    stop = threading.Event()
    rank.engine.on_drained = stop.set  # the group drained (this rank's signal or a peer's)

    def on_signal(*_) -> None:
        # Repeated signals change nothing (Ctrl-C reaches a launcher's ranks too, and the
        # launcher passes it on): stopping one rank early would stall its peers.
        if not rank.engine.drain_requested:
            log.info("rank %d draining its group (up to %g s)", cfg.rank, cfg.drain_timeout_s)
            rank.engine.drain()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    stop.wait()
    log.info("rank %d stopping", cfg.rank)
    rank.link.stop(grace=2.0)
    rank.engine.stop()
    return 0

