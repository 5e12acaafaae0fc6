"""The Worker gRPC service of one rank: translates between protos and the engine.

`serve(cfg)` builds the rank (distributed groups, model, slot table, grammar cache, engine)
and its server; `main(argv)` is `gramserve worker`.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry

from gpu_worker.config import WorkerConfig
from gpu_worker.control import engine as eng
from gpu_worker.control.lockstep import ControlChannel
from gpu_worker.control.slots import NoFreeSlot, SlotBusy, SlotTable, UnknownRequest
from gpu_worker.guided.grammar_cache import WorkerGrammarCache
from gpu_worker.metrics import WorkerMetrics
from gpu_worker.runtime.loader import load_model
from gpu_worker.runtime.parallel import init_distributed
from grammar_service.default_model import resolve_model
from grammar_service.vocab import Vocab, load_vocab
from protos import common_pb2, worker_pb2, worker_pb2_grpc
from protos.rpc import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    create_server,
    set_serving,
    start_metrics_server,
)

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
DEFAULT_MAX_TOKENS = 256
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
    s = msg.sampling
    max_tokens = s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    temperature = s.temperature if s.HasField("temperature") else 1.0
    top_p = s.top_p if s.HasField("top_p") else 1.0
    for ok, name, why in [
        (max_tokens >= 1, "max_tokens", "must be >= 1"),
        (math.isfinite(temperature) and temperature >= 0, "temperature", "must be finite and >= 0"),
        (math.isfinite(top_p) and 0 < top_p <= 1, "top_p", "must be in (0, 1]"),
        (s.top_k >= 0, "top_k", "must be >= 0"),
        (math.isfinite(s.min_p) and 0 <= s.min_p <= 1, "min_p", "must be in [0, 1]"),
        (s.min_tokens >= 0, "min_tokens", "must be >= 0"),
        (all(t < vocab.model_vocab_size for t in s.stop_token_ids), "stop_token_ids",
         f"ids must be < {vocab.model_vocab_size}"),
    ]:
        if not ok:
            raise InvalidArgument(why, field=f"sampling.{name}")
    return eng.Request(
        request_id=msg.request_id, prompt=prompt, max_tokens=max_tokens,
        temperature=temperature, top_k=s.top_k, top_p=top_p, min_p=s.min_p,
        seed=s.seed & ((1 << 63) - 1) if s.HasField("seed") else 0,
        stop_token_ids=frozenset(s.stop_token_ids), ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens)


def finished_event(event: tuple) -> worker_pb2.AdmitEvent:
    _, reason, message, prompt_tokens, completion, start_s, first_s = event
    return worker_pb2.AdmitEvent(finished=worker_pb2.Finished(
        reason=_FINISH[reason], message=message,
        usage=common_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion),
        start_seconds=start_s, first_token_seconds=first_s))


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Admit / Release / Info of one rank."""

    def __init__(self, rank: Rank):
        self.r = rank

    def Admit(self, request, context):
        r = self.r
        if not r.serving:
            raise Unavailable("this worker rank lost its group and is shutting down")
        req = request_from_proto(request, r.vocab, r.cfg.max_model_len)
        if request.grammar_key:
            handle = r.grammars.acquire(request.grammar_key,
                                        request.grammar if request.HasField("grammar") else None)
            req.grammar, req.release_grammar = handle, r.grammars.release
        try:
            if req.grammar is not None:
                req.matcher = req.grammar.new_matcher()  # this rank's own (I1)
            if r.cfg.rank == 0:
                if request.slot != -1:
                    raise FailedPrecondition("rank 0 allocates slots: send slot = -1", field="slot")
                req.events = queue.Queue()
                try:
                    entry = r.table.allocate(req.request_id, req, on_drop=_dropped)
                except NoFreeSlot as exc:
                    raise ResourceExhausted(str(exc)) from None
            else:
                try:
                    entry = r.table.register(request.slot, req.request_id, req, on_drop=_dropped)
                except IndexError as exc:
                    raise InvalidArgument(str(exc), field="slot") from None
                except (SlotBusy, UnknownRequest) as exc:
                    raise FailedPrecondition(str(exc), field="slot") from None
        except BaseException:
            req.close()
            raise
        if r.cfg.rank != 0:
            yield worker_pb2.AdmitEvent(admitted=worker_pb2.Admitted(slot=entry.slot, rank=r.cfg.rank))
            return
        done = threading.Event()

        def on_rpc_end():
            if not done.is_set():  # the caller vanished: free the slot on every rank
                try:
                    r.table.request_release(entry.slot, entry.request_id)
                except UnknownRequest:
                    pass

        if not context.add_callback(on_rpc_end):  # the caller is already gone
            on_rpc_end()
            return
        yield worker_pb2.AdmitEvent(admitted=worker_pb2.Admitted(slot=entry.slot, rank=0))
        while True:
            try:
                event = req.events.get(timeout=1.0)
            except queue.Empty:
                if not context.is_active():
                    return  # on_rpc_end has asked for the release
                continue
            if event[0] == "tokens":
                yield worker_pb2.AdmitEvent(tokens=worker_pb2.Tokens(token_ids=event[1]))
                continue
            done.set()
            if event[0] == "dropped":
                if event[1] == "released":
                    yield finished_event(("finished", eng.CANCELLED, "released before it started",
                                          len(req.prompt), 0, 0.0, 0.0))
                    return
                raise Unavailable(f"request was not started on every rank: {event[1]}")
            if event[1] == eng.UNAVAILABLE:
                raise Unavailable(event[2])
            yield finished_event(event)
            return

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
            dtype=str(r.dtype).removeprefix("torch."), serving=r.serving)


def _dropped(entry, reason: str) -> None:
    """A pending Admit left the table without starting: free its grammar, tell its stream."""
    entry.payload.close()
    entry.payload.emit("dropped", reason)


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
    serving: bool = True


def _device_and_dtype(cfg: WorkerConfig) -> tuple[torch.device, torch.dtype]:
    kind = cfg.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible")
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dtype = names.get(cfg.dtype, torch.bfloat16 if kind == "cuda" else torch.float32)
    return device, dtype


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
    table = SlotTable(cfg.slots, is_rank0=cfg.rank == 0, admit_timeout_s=cfg.admit_timeout_s)
    tls_ca = open(cfg.tls_ca, "rb").read() if cfg.tls_ca else None
    grammars = WorkerGrammarCache(cfg.grammar_service, vocab, cfg.grammar_cache_bytes,
                                  metrics=metrics, tls_ca=tls_ca)
    engine = eng.Engine(
        eng.EngineConfig(num_slots=cfg.slots, max_model_len=cfg.max_model_len,
                         step_tokens=cfg.step_tokens,
                         divergence_check_every=cfg.divergence_check_every,
                         cuda_graph_max_batch=cfg.cuda_graph_max_batch,
                         mask_fill_threads=cfg.mask_fill_threads),
        model, table, ControlChannel(control_group, cfg.tp),
        vocab_size=vocab.vocab_size, model_vocab_size=model.config.vocab_size,
        eos_token_ids=vocab.eos_token_ids, device=device, metrics=metrics)
    return Rank(cfg, model_dir, vocab, device, dtype, table, grammars, engine, metrics)


def serve(cfg: WorkerConfig, registry: CollectorRegistry | None = None):
    """Start the rank and its gRPC server; return (server, port, rank). Blocks until the
    group is formed (every rank must be started)."""
    registry = registry or CollectorRegistry()
    rank = build_rank(cfg, registry)
    tls = None
    if cfg.tls_cert:
        tls = (open(cfg.tls_cert, "rb").read(), open(cfg.tls_key, "rb").read())
    server, port, health = create_server(
        [(worker_pb2_grpc.add_WorkerServicer_to_server, WorkerServicer(rank), SERVICE_NAME)],
        host=cfg.host, port=cfg.port, tls=tls)

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

    rank.engine.on_fatal = on_fatal
    rank.engine.start()
    start_metrics_server(cfg.metrics_port, registry)
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
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("rank %d stopping", cfg.rank)
    server.stop(grace=2.0).wait(3.0)
    rank.engine.stop()
    return 0

