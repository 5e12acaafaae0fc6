"""The Worker gRPC service of one rank: translates between protos and the engine.

`serve(cfg)` builds the rank (distributed groups, model, slot table, grammar cache, engine)
and its server; `main(argv)` is `gramserve worker`. SIGTERM drains the rank's whole group
(gpu_worker/control/engine.py): every rank reports NOT_SERVING and refuses admissions with
UNAVAILABLE (the gateway admits the request on another group), running requests finish for
up to --drain-timeout seconds, then every rank exits 0.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

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
from protos import common_pb2, worker_pb2, worker_pb2_grpc
from protos.rpc import (
    ConstantLabels,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unavailable,
    create_server,
    register_build_info,
    set_serving,
    start_metrics_server,
)
from protos.sampling import Sampling

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
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


def finished_proto(finish: eng.Finish, prompt_tokens: int) -> worker_pb2.Finished:
    return worker_pb2.Finished(
        reason=_FINISH.get(finish.reason, common_pb2.FINISH_REASON_ERROR_INTERNAL),
        message=finish.message, code=finish.code,
        usage=common_pb2.Usage(prompt_tokens=prompt_tokens,
                               completion_tokens=finish.completion_tokens),
        start_seconds=finish.start_seconds, first_token_seconds=finish.first_token_seconds)


def step_update(step: int, outputs: list[eng.RowOutput]) -> worker_pb2.SessionEvent:
    """One session's rows of one step, as the message rank 0 sends. Rows are added in place
    (`rows.add`): building each RowUpdate apart and copying it into the list took 2.4x the
    time, all of it holding the GIL that the engine thread needs between its CUDA calls."""
    event = worker_pb2.SessionEvent()
    update = event.step
    update.step = step
    add = update.rows.add
    for out in outputs:
        row = add(tag=out.req.tag, token_ids=out.tokens)
        if out.logprobs:
            for token, (logprob, top_ids, top_lps) in zip(out.tokens, out.logprobs,
                                                          strict=False):
                row.logprobs.add(token_id=token, logprob=logprob, top_token_ids=top_ids,
                                 top_logprobs=top_lps)
        if out.finish is not None:
            row.finished.CopyFrom(finished_proto(out.finish, len(out.req.prompt)))
    return event


class Session:
    """One gateway's Session stream on this rank: its outgoing queue and its live requests.

    Engine outputs, admission results and drops are put on `out` from any thread; the
    stream's handler thread turns them into messages, so the engine thread never builds a
    protobuf. `live` holds the entries this session admitted, so that a vanished gateway's
    requests are released.
    """

    _CLOSE = object()

    def __init__(self, rank: Rank):
        self.rank = rank
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.live: dict[int, object] = {}  # tag -> slots.Entry
        self.lock = threading.Lock()
        self.closed = False

    def events(self, context) -> Iterator[worker_pb2.SessionEvent]:
        """The stream's outgoing messages until the session closes."""
        while True:
            try:
                item = self.out.get(timeout=1.0)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            if item is self._CLOSE:
                return
            if isinstance(item, tuple):  # (step, [RowOutput, ...]) from the engine
                for out in item[1]:
                    if out.finish is not None:
                        with self.lock:
                            self.live.pop(out.req.tag, None)
                yield step_update(*item)
            else:
                yield item

    def read(self, requests: Iterator[worker_pb2.SessionRequest]) -> None:
        """Serve the incoming admissions and releases until the gateway closes its side."""
        try:
            for msg in requests:
                if msg.HasField("admit"):
                    self.rank.admit_pool.submit(self._admit, msg.admit)
                elif msg.HasField("release"):
                    try:
                        self.rank.table.request_release(msg.release.slot, msg.release.request_id)
                    except (IndexError, UnknownRequest):
                        pass  # stale or double: the request is gone already
        except grpc.RpcError:
            pass  # the stream broke: the gateway is gone
        finally:
            self.close()

    def close(self) -> None:
        """Release every request this session still holds, on every rank, and end the stream."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            live, self.live = list(self.live.values()), {}
        for entry in live:
            try:
                self.rank.table.request_release(entry.slot, entry.request_id)
            except (IndexError, UnknownRequest):
                pass
        self.out.put(self._CLOSE)

    def _admit(self, msg: worker_pb2.AdmitRequest) -> None:
        r = self.rank
        try:
            entry = r.admit(msg, self)
        except ServiceError as exc:
            self.out.put(worker_pb2.SessionEvent(admitted=worker_pb2.AdmitResult(
                tag=msg.tag, code=exc.code.value[0], message=str(exc), rank=r.cfg.rank)))
            return
        except Exception as exc:  # a bug: the request fails, the rank goes on
            log.exception("admit failed")
            self.out.put(worker_pb2.SessionEvent(admitted=worker_pb2.AdmitResult(
                tag=msg.tag, code=grpc.StatusCode.INTERNAL.value[0],
                message=f"internal error: {type(exc).__name__}", rank=r.cfg.rank)))
            return
        with self.lock:
            closed = self.closed
            if not closed:
                self.live[msg.tag] = entry
        if closed:  # the gateway left while this admission ran
            try:
                r.table.request_release(entry.slot, entry.request_id)
            except (IndexError, UnknownRequest):
                pass
            return
        self.out.put(worker_pb2.SessionEvent(admitted=worker_pb2.AdmitResult(
            tag=msg.tag, code=0, slot=entry.slot, rank=r.cfg.rank)))

    def dropped(self, req: eng.Request, reason: str) -> None:
        """A pending request left the table without starting (rank 0): tell the gateway."""
        with self.lock:
            self.live.pop(req.tag, None)
        if reason == "released":
            finish = eng.Finish(eng.CANCELLED, "released before it started")
        else:
            finish = eng.Finish(eng.UNAVAILABLE, f"request was not started on every rank: {reason}",
                                code=grpc.StatusCode.UNAVAILABLE.value[0])
        self.out.put((0, [eng.RowOutput(req, [], finish)]))


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Session / Release / Info of one rank: thin over `Rank`."""

    def __init__(self, rank: Rank):
        self.r = rank

    def Session(self, request_iterator, context):
        if not self.r.serving:
            raise Unavailable("this worker rank lost its group and is shutting down")
        session = Session(self.r)
        context.add_callback(session.close)
        threading.Thread(target=session.read, args=(request_iterator,), daemon=True,
                         name="session-reader").start()
        yield from session.events(context)

    def Release(self, request, context):
        try:
            was_running = self.r.table.request_release(request.slot, request.request_id)
        except IndexError as exc:
            raise InvalidArgument(str(exc), field="slot") from None
        except UnknownRequest as exc:
            raise NotFound(str(exc)) from None
        return worker_pb2.ReleaseResponse(was_running=was_running)

    def Info(self, request, context):
        r = self.r
        slots = []
        runs = dict(r.engine.runs)
        for i, (state, entry) in enumerate(r.table.snapshot()):
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
        return worker_pb2.WorkerInfo(
            rank=r.cfg.rank, tp_size=r.cfg.tp, num_slots=r.cfg.slots,
            max_model_len=r.cfg.max_model_len, model=str(r.model_dir),
            vocab_fingerprint=r.vocab.fingerprint, vocab_size=r.vocab.vocab_size,
            model_vocab_size=r.vocab.model_vocab_size, slots=slots, device=str(r.device),
            dtype=str(r.dtype).removeprefix("torch."), serving=r.serving and not r.draining)


def _dropped(entry, reason: str) -> None:
    """A pending Admit left the table without starting: free its grammar, tell its session."""
    req = entry.payload
    req.close()
    if req.session is not None:
        req.session.dropped(req, reason)


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

    @property
    def draining(self) -> bool:
        """This rank was told to drain, or its group drains."""
        return self.engine.drain_requested or self.engine.draining

    def admit(self, msg: worker_pb2.AdmitRequest, session: Session) -> Entry:
        """Validate an Admit, pin its grammar, build this rank's own matcher (I1) and claim
        the slot (rank 0 allocates; other ranks register rank 0's choice). Raises
        ServiceError; on failure nothing is held."""
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
                    return self.table.allocate(req.request_id, req, on_drop=_dropped)
                except NoFreeSlot as exc:
                    raise ResourceExhausted(str(exc)) from None
            try:
                return self.table.register(msg.slot, req.request_id, req, on_drop=_dropped)
            except IndexError as exc:
                raise InvalidArgument(str(exc), field="slot") from None
            except (SlotBusy, UnknownRequest) as exc:
                raise FailedPrecondition(str(exc), field="slot") from None
        except BaseException:
            req.close()
            raise

    def publish(self, outputs: list[eng.RowOutput]) -> None:
        """Engine thread: hand each session its rows of this step (one message per session)."""
        by_session: dict[int, tuple[Session, list]] = {}
        for out in outputs:
            session = out.req.session
            if session is not None:
                by_session.setdefault(id(session), (session, []))[1].append(out)
        step = self.engine.step_index
        for session, rows in by_session.values():
            session.out.put((step, rows))


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
    if cfg.rank == 0:
        engine.publish = rank.publish
    return rank


def serve(cfg: WorkerConfig, registry: CollectorRegistry | None = None):
    """Start the rank and its gRPC server; return (server, port, rank). Blocks until the
    group is formed (every rank must be started)."""
    registry = registry or CollectorRegistry()
    rank = build_rank(cfg, registry)
    client_ca = open(cfg.tls_client_ca, "rb").read() if cfg.tls_client_ca else None
    server, port, health = create_server(
        [(worker_pb2_grpc.add_WorkerServicer_to_server, WorkerServicer(rank), SERVICE_NAME)],
        host=cfg.host, port=cfg.port, tls=_tls_pair(cfg), client_ca=client_ca,
        reflection=cfg.reflection == "on")

    def on_fatal(exc: BaseException) -> None:
        # A rank without its peers can do nothing useful: say so, let streams carry the
        # error out, then exit so that a supervisor restarts the whole group.
        rank.serving = False
        set_serving(health, [SERVICE_NAME], False)

        def die():
            time.sleep(1.0)
            server.stop(0.5)
            os._exit(3)

        threading.Thread(target=die, daemon=True).start()

    def on_drain() -> None:
        # Out of the gateways' rotation at their next health check; admissions are refused
        # meanwhile (Rank.admit), which they retry on another group.
        set_serving(health, [SERVICE_NAME], False)
        rank.metrics.draining.set(1)

    rank.engine.on_fatal = on_fatal
    rank.engine.on_drain = on_drain
    rank.engine.start()
    register_build_info(registry, "worker", torch=torch.__version__,
                        xgrammar=importlib.metadata.version("xgrammar"))
    start_metrics_server(cfg.metrics_port, ConstantLabels(registry, rank=str(cfg.rank)),
                         host=cfg.metrics_host)
    log.info("worker rank %d/%d serving on %s:%d (model %s, %s, %d slots)", cfg.rank, cfg.tp,
             cfg.host, port, rank.model_dir, rank.device, cfg.slots)
    return server, port, rank


def main(argv: list[str] | None = None) -> int:
    """`gramserve worker`: run one rank until SIGTERM/SIGINT."""
    logging.basicConfig(level=os.environ.get("GRAMSERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = WorkerConfig.from_args(argv)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    server, _, rank = serve(cfg)
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
    server.stop(grace=2.0).wait(3.0)
    rank.engine.stop()
    return 0

