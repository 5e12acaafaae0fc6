"""The whole stack under load, side by side with its own engine alone and with transformers.

One run, one table: a random-weight Qwen2.5-0.5B-shaped checkpoint (bf16) with a 150k-token
byte-level BPE is served by the real stack (`gramserve up`, TP=1, 256 slots), and
`gramserve bench` drives it at concurrency 64 and 256 with 0 / 20 / 80 / 100 % of the
requests guided by the short (10-40 tokens) or long (~100 tokens) schema family of
bench/schemas/, 128 max tokens. Then, with the stack stopped, the same weights: the graphed
decode step alone (bench/step.py) at batch 64 and 256, the engine's whole step unguided and
guided at batch 64, and transformers `generate` at batch 64, unconstrained and with xgrammar's
logits processor (one compiled grammar per row). Writes serve.txt (table + raw lines) and
serve.json into --out.

    # H200 (about 6 minutes); the tokenizer file is made once, anywhere, by the next command
    PYTHONPATH=$PWD python bench/serve.py --tokenizer .bench/tok150k.json --out $OUT
    # the tokenizer: trained on the .py/.txt/.md/.rst files of this Python's stdlib and
    # site-packages, first 150 MB in path order (about a minute on 2 cores, 11 MB file)
    PYTHONPATH=$PWD python bench/serve.py --train-tokenizer --tokenizer .bench/tok150k.json \
        --train-only
    # CPU smoke test of the script (embedded default model's tokenizer, tiny shape, no HF)
    PYTHONPATH=$PWD python bench/serve.py --device cpu --tiny --out /tmp/serve
    # tokens per answer of the schema families under a random sampler (CPU)
    PYTHONPATH=$PWD python bench/serve.py --check-schemas --tokenizer .bench/tok150k.json

Every wait has a timeout; the stack's processes are killed (SIGTERM, then SIGKILL) at the
end and on any error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.loadgen import BACKEND_NAMES  # noqa: E402

_T0 = time.monotonic()
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - _T0:6.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------------- tokenizer

def train_tokenizer(out: Path, vocab_size: int = 151_000, corpus_mb: int = 150) -> Path:
    """Train a byte-level BPE (ByteLevel pre-tokenizer and decoder, no BOS, `SPECIAL_TOKENS`
    first) of `vocab_size` ids on this Python's stdlib and site-packages text files, the
    first `corpus_mb` MB in sorted path order; save it to `out`. Raises RuntimeError when the
    corpus is too small for the vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        total, limit = 0, corpus_mb * 1_000_000
        for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*")):
            if path.suffix not in (".py", ".txt", ".md", ".rst") or not path.is_file():
                continue
            try:
                if path.stat().st_size > 2_000_000:
                    continue
                text = path.read_text(encoding="utf-8", errors="ignore")
            except OSError:
                continue
            yield text
            total += len(text)
            if total >= limit:
                return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(SPECIAL_TOKENS))
    tok.train_from_iterator(texts(), trainer=trainer)
    if tok.get_vocab_size(with_added_tokens=True) < vocab_size:
        raise RuntimeError(f"corpus too small: {tok.get_vocab_size()} of {vocab_size} tokens")
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out


# ------------------------------------------------------------------------------- the stack

def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class Stack:
    """`gramserve up` as a subprocess in its own session; `stop` ends it and everything it
    started (their process groups, found while they live)."""

    def __init__(self, args: list[str], env: dict, log_path: Path, cwd: Path = ROOT):
        self.args, self.env, self.log_path, self.cwd = args, env, log_path, cwd
        self.proc: subprocess.Popen | None = None
        self.lines: queue.Queue[str] = queue.Queue()
        self.addr = ""
        self.metrics: dict[str, str] = {}

    def start(self, timeout: float) -> str:
        """Start and wait for `gramserve is up: gateway ADDR`; return ADDR. Raises
        RuntimeError when the stack exits or is not up within `timeout` seconds."""
        log = self.log_path.open("a")
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "up", *self.args],
                                     stdout=subprocess.PIPE, stderr=log, text=True,
                                     env=self.env, start_new_session=True, cwd=self.cwd)
        threading.Thread(target=self._read, args=(log,), daemon=True).start()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"gramserve up exited with {self.proc.returncode}; "
                                       f"see {self.log_path}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gramserve up not up after {timeout:.0f} s") from None
                continue
            m = re.match(r"gramserve is up: gateway (\S+)", line)
            if m:
                self.addr = m.group(1)
            m = re.match(r"\s+metrics (.+): (http://\S+)", line)
            if m:
                self.metrics[m.group(1)] = m.group(2)
            if line.startswith("Ctrl-C") and self.addr:
                return self.addr

    def _read(self, log) -> None:
        for line in self.proc.stdout:
            log.write(line)
            log.flush()
            self.lines.put(line)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM `up` (it stops its children), SIGKILL whatever is left after `timeout`."""
        if self.proc is None:
            return
        groups = {self.proc.pid}
        for pid in _descendants(self.proc.pid):
            try:
                groups.add(os.getpgid(pid))
            except ProcessLookupError:
                pass
        _killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        for g in groups:
            _killpg(g, signal.SIGKILL)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            say(f"gramserve up (pid {self.proc.pid}) did not exit after SIGKILL")


def roles(root: int) -> dict[str, int]:
    """The stack's processes by role (gateway, rank0, rank1, ..., the ranks' gRPC fronts
    front0, front1, ..., grammar), from their command lines; compile-pool children and
    helpers are left out."""
    out = {}
    for pid in _descendants(root):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if "-m" not in args:
            continue
        module = args[args.index("-m") + 1] if args.index("-m") + 1 < len(args) else ""
        if module == "gateway":
            out[f"gateway{sum(k.startswith('gateway') for k in out)}"] = pid
        elif module == "grammar_service":
            out["grammar"] = pid
        elif module == "gpu_worker.control.front":
            out[f"front{sum(k.startswith('front') for k in out)}"] = pid
        elif module == "gpu_worker" and "--rank" in args:
            name = f"rank{args[args.index('--rank') + 1]}"  # group 0's; then rank0-2, ...
            n = sum(k == name or k.startswith(name + "-") for k in out)
            out[name if not n else f"{name}-{n + 1}"] = pid
    return out


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds of each process (all its threads), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for role, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[role] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def scrape(url: str) -> dict[str, float]:
    """The worker's step/batch/mask histograms' _sum and _count, by phase ({} on failure)."""
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for m in re.finditer(r"^(gramserve_worker_\w+)(?:\{([^}]*)\})? (\S+)$", text, re.M):
        name, labels, value = m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")), m.group(3)
        if re.fullmatch(r"gramserve_worker_(step_seconds|batch_size|mask_\w+?_seconds|device_wait_seconds|step_cpu_seconds)"
                        r"_(sum|count)",
                        name):
            out[name + (f":{labels['phase']}" if "phase" in labels else "")] = float(value)
        elif (name in ("gramserve_worker_forced_tokens_total", "gramserve_worker_mask_fills_total",
                       "gramserve_worker_accept_first_total", "gramserve_worker_resamples_total",
                       "gramserve_worker_decode_row_forwards_total",
                       "gramserve_worker_forced_chain_rounds_total",
                       "gramserve_worker_drafted_tokens_total",
                       "gramserve_worker_draft_accepted_total")
              or (name == "gramserve_worker_tokens_total" and labels.get("kind") == "generated")):
            key = "counter:" + name.removeprefix("gramserve_worker_").removesuffix("_total")
            out[key] = float(value)
    return out


def scrape_all(urls: list[str]) -> dict[str, float]:
    """`scrape` of each URL, summed (sums, counts and counters add up across groups)."""
    out: dict[str, float] = {}
    for url in urls:
        for k, v in scrape(url).items():
            out[k] = out.get(k, 0.0) + v
    return out


def metrics_delta(before: dict, after: dict) -> dict[str, float]:
    """Mean step ms by phase, mean batch and mean mask ms over the run between two scrapes."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    out = {}
    generated = d.get("counter:tokens", 0.0)
    if generated > 0:  # per output token: forced ones, masks filled, rows forwarded
        for name, key in (("forced_share", "forced_tokens"), ("fills_per_token", "mask_fills"),
                          ("steps_per_token", "decode_row_forwards"),
                          ("accept_first_per_token", "accept_first"),
                          ("resamples_per_token", "resamples"),
                          ("drafted_per_token", "drafted_tokens"),
                          ("draft_accepted_per_token", "draft_accepted")):
            out[name] = round(d.get(f"counter:{key}", 0.0) / generated, 4)
    steps = sum(n for k, n in d.items() if k.startswith("gramserve_worker_step_seconds_count"))
    if steps > 0:  # fill rounds on the critical path that followed forced chains
        out["chain_rounds_per_step"] = round(d.get("counter:forced_chain_rounds", 0.0) / steps, 4)
    for key, n in d.items():
        if not key.startswith("gramserve_worker_") or "_count" not in key or n <= 0:
            continue
        total = d.get(key.replace("_count", "_sum"), 0.0)
        name = key.replace("gramserve_worker_", "").replace("_count", "")
        scale = 1.0 if name.startswith("batch_size") else 1e3
        out[f"{name}_mean{'' if scale == 1.0 else '_ms'}"] = total / n * scale
        if name.startswith("step_seconds"):
            out[f"{name}_steps"] = n
    return out


# ------------------------------------------------------------------------------- load runs

def run_load(addr: str, concurrency: int, family: str, ratio: float, ns, *, duration: float,
             requests: int = 0, warmup: int = 0, http: str = "",
             schema_prompts: bool = False, twin: int = 0) -> dict:
    """One `gramserve bench --json` run as a subprocess (with a timeout); its summary. With
    `http` (a base URL) the load goes through the OpenAI-compatible API instead of gRPC;
    `schema_prompts`: guided prompts name their schema (a model fine-tuned on them); `twin`:
    the guided requests sent without their grammar, `twin` tokens each (--unguided-twin)."""
    processes = max(1, min(ns.client_processes, concurrency // 16 or 1))
    family, backend, fixed = grammar_variant(family, ns.backend)
    cmd = [sys.executable, "-m", "gateway.cli", "bench", "--addr", addr, "--json",
           "--no-progress", "--concurrency", str(concurrency), "--processes", str(processes),
           "--structured-ratio", str(ratio), "--schema-family", family,
           "--max-tokens", str(ns.max_tokens), "--timeout", str(ns.request_timeout),
           "--backend", backend,
           "--warmup", str(warmup), "--seed", str(int(ratio * 100) + concurrency)]
    if fixed:
        cmd.append("--fixed-property-order")
    if schema_prompts:
        cmd.append("--schema-prompts")
    if twin:
        cmd += ["--unguided-twin", str(twin)]
    cmd += ["--duration", str(duration)] if duration else ["--requests", str(requests)]
    cmd += ["--http", http] if http else []
    budget = (duration or 0) + ns.request_timeout * (2 + warmup + requests / concurrency) + 120
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget, cwd=ROOT,
                          env=os.environ.copy())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"gramserve bench exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def grammar_variant(family: str, backend: str) -> tuple[str, str, bool]:
    """A family as the runs name it, `name[@option...]` (options: a backend of BACKEND_NAMES,
    `fixed` for the schemas' own property order), as (schema family, backend, fixed order);
    `backend` where the name gives none. So one stack serves the same schemas with other
    request options, e.g. `long@fixed`, `long@xgrammar`. Raises ValueError for an unknown
    option."""
    name, *options = family.split("@")
    fixed = False
    for option in options:
        if option in BACKEND_NAMES:
            backend = option
        elif option == "fixed":
            fixed = True
        else:
            raise ValueError(f"family {family!r}: unknown option {option!r} (a backend of "
                             f"{', '.join(BACKEND_NAMES)}, or fixed)")
    return name, backend, fixed


def matrix_plan(ns) -> list[tuple[int, str, float]]:
    """(concurrency, family, ratio) of every run: unguided, then each family and ratio."""
    return [(c, family, ratio) for c in ns.concurrency
            for family, ratio in [("-", 0.0)] + [(f, r) for f in ns.families
                                                 for r in ns.ratios if r > 0]]


def interleave(plans: dict[str, list], rounds: int):
    """(round, run, setting) in the order runs are made: each round goes through the runs of
    the first setting's plan (then the runs only other settings have), each run under every
    setting whose plan has it, the settings' order reversed every other round."""
    order = list(dict.fromkeys(run for plan in plans.values() for run in plan))
    for rnd in range(1, rounds + 1):
        names = list(plans) if rnd % 2 else list(reversed(plans))
        for run in order:
            for name in names:
                if run in plans[name]:
                    yield rnd, run, name


# --shortcuts settings: (forced tokens, accept-first, forced round cost, draft tokens) of the
# worker; None is the worker's default; a round cost of 0 follows every forced chain at once
# (every round)
SHORTCUTS = {"on": (True, True, None, None), "off": (False, False, None, 0),
             "forced": (True, False, None, 0), "accept-first": (False, True, None, 0),
             "every-round": (True, True, 0.0, None), "no-drafts": (True, True, None, 0),
             "drafts4": (True, True, None, 4)}


def split_setting(setting: str) -> tuple[str, int, str]:
    """(shortcuts, worker groups, tree) of a --shortcuts setting such as on, on*2, off@base:
    `*N` runs N TP=1 worker groups (model replicas) on the one GPU, each its own process with
    its own engine thread; `@base` the code of --base-tree."""
    name, _, tree = setting.partition("@")
    name, star, groups = name.partition("*")
    # 0 for a `*` without a count: parse_args refuses fewer than one group
    return name, (int(groups) if groups.isdigit() else 0) if star else 1, tree


def run_matrix(addr: str, stack: Stack, ns, say_line, plan, shortcuts: str,
               rnd: int = 1) -> list[dict]:
    """Every (concurrency, family, ratio) run of `plan` (and, with --twins, each 100 % guided
    run's unguided twin right after it); returns one row dict each."""
    # Every group's rank 0 (one per model replica): their counters and histograms summed.
    worker_urls = [u for k, u in stack.metrics.items() if k.endswith("rank 0")]
    pids = roles(stack.proc.pid)
    rows = []

    def measured(c: int, family: str, ratio: float, twin: int = 0) -> dict:
        before = scrape_all(worker_urls)
        cpu0 = cpu_seconds(pids)
        t0 = time.monotonic()
        # A guided run's twin is sampled with it (its name ends in -twin).
        spies = (start_profile(pids, ns, f"{shortcuts}-r{rnd}-c{c}-{family}-{ratio:g}"
                                         + ("-twin" if twin else ""))
                 if f"{c}:{family}:{ratio:g}" in ns.profile else [])
        summary = run_load(addr, c, "short" if family == "-" else family, ratio, ns,
                           duration=ns.duration, requests=ns.requests,
                           schema_prompts=bool(ns.train_steps), twin=twin)
        wall = time.monotonic() - t0
        cpu1 = cpu_seconds(pids)
        after = scrape_all(worker_urls)
        for spy in spies:
            try:
                spy.wait(30)
            except subprocess.TimeoutExpired:
                spy.kill()
        # CPU cores each process kept busy over the run (1.0 = one core saturated)
        cores = {k: round((cpu1[k] - cpu0.get(k, 0.0)) / wall, 2) for k in cpu1}
        gw = [v for k, v in cores.items() if k.startswith("gateway")]
        cores.update(gateways_sum=round(sum(gw), 2), gateways_max=max(gw, default=0.0))
        row = {"concurrency": c, "family": f"{family} twin" if twin else family,
               "ratio": 0.0 if twin else ratio, "shortcuts": shortcuts, "round": rnd,
               **summary, "worker": metrics_delta(before, after), "wall_s": wall,
               "cpu_cores": cores}
        if twin:
            row["twin"] = twin
        say_line(f"run round={rnd} shortcuts={shortcuts} c={c} family={row['family']} "
                 f"ratio={row['ratio']}{f' ({twin} tokens each)' if twin else ''}: "
                 f"{summary['output_tokens_per_second']:.0f} tok/s, "
                 f"{summary['ok']}/{summary['requests']} ok, errors {summary['errors']}, "
                 f"finish {summary['finish_reasons']}, "
                 f"tokens/delta {summary['tokens_per_delta']:.2f}, "
                 f"cpu cores {row['cpu_cores']}, worker {row['worker']}")
        return row

    for c, family, ratio in plan:
        row = measured(c, family, ratio)
        rows.append(row)
        if ns.twins and ratio == 1.0 and row["requests_per_second"]:
            # The same requests without their grammar, as long as the guided answers were
            # on average: what the grammar itself costs, the per-request work equal.
            rows.append(measured(c, family, ratio, twin=max(1, round(
                row["output_tokens_per_second"] / row["requests_per_second"]))))
    return rows


def start_profile(pids: dict[str, int], ns, name: str) -> list[subprocess.Popen]:
    """py-spy (from PATH or $PYSPY) sampling the gateway and rank 0 for the run's duration,
    collapsed stacks per thread into --out/pyspy-<name>-<role>.txt (wall clock, idle kept),
    and with --profile-gil also -<role>-gil.txt (only samples holding the GIL)."""
    import shutil

    exe = os.environ.get("PYSPY") or shutil.which("py-spy")
    if not exe:
        say("no py-spy on PATH: not profiling")
        return []
    spies = []
    for role in ("gateway0", "rank0"):
        if role not in pids:
            continue
        for mode in ("--idle", "--gil") if ns.profile_gil else ("--idle",):
            out = ns.out / (f"pyspy-{name}-{role}{'-gil' if mode == '--gil' else ''}.txt"
                            .replace("@", "-"))
            spies.append(subprocess.Popen(
                [exe, "record", "-p", str(pids[role]), "-d", str(max(1, int(ns.duration or 5))),
                 "-r", "250", "--threads", mode, "-f", "raw", "-o", str(out), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return spies


# ------------------------------------------------------------------------------- client check

def _fake_gateway(port: int) -> None:
    """A gateway stand-in that streams max_tokens one-token deltas as fast as it can."""
    import asyncio

    import grpc

    from protos import common_pb2, gateway_pb2, gateway_pb2_grpc

    class Fake(gateway_pb2_grpc.GatewayServicer):
        async def Generate(self, request, context):
            n = request.sampling.max_tokens
            for i in range(n):
                yield gateway_pb2.GenerateResponse(delta=gateway_pb2.Delta(text="a",
                                                                           token_ids=[i]))
            yield gateway_pb2.GenerateResponse(final=gateway_pb2.Final(
                finish_reason=common_pb2.FINISH_REASON_LENGTH,
                usage=common_pb2.Usage(completion_tokens=n)))

    async def serve():
        server = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
        gateway_pb2_grpc.add_GatewayServicer_to_server(Fake(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def client_check(ns, concurrency: int, servers: int) -> dict:
    """What the load generator alone can drive: `servers` fake-gateway processes sharing one
    port (SO_REUSEPORT), unguided, the same flags as a real run."""
    import multiprocessing

    from gateway.launcher import free_ports
    from protos.rpc import check_health  # noqa: F401  (fails early without grpc)

    port = free_ports(1, set())
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_fake_gateway, args=(port,), daemon=True)
             for _ in range(servers)]
    for proc in procs:
        proc.start()
    try:
        time.sleep(3.0)  # the servers bind; a request before that fails UNAVAILABLE
        return run_load(f"127.0.0.1:{port}", concurrency, "short", 0.0, ns,
                        duration=min(ns.duration, 5.0), requests=ns.requests or 4 * concurrency)
    finally:
        for proc in procs:
            proc.kill()
            proc.join(5)


# ------------------------------------------------------------------------------- same weights

def engine_alone(model_dir: Path, ns, device, dtype, out: dict) -> None:
    """Graphed (eager on CPU) decode step at each concurrency; engine step at batch 64.
    Fills `out` as it goes, so a failure keeps what was measured."""
    import torch

    from bench.step import build_model, prefill, time_decode_step, time_engine_steps

    batches = sorted(ns.concurrency)
    model = build_model(model_dir, device, dtype, max(batches) + 1, ns.max_model_len)
    graph = device.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    for b in batches:
        prefill(model, torch.randint(0, 1000, (b, ns.context), generator=gen))
        r = time_decode_step(model, b, context=ns.context, steps=ns.steps, graph=graph)
        out[f"decode_b{b}"] = r
        say(f"engine alone: {'graphed' if graph else 'eager'} decode step batch {b}: "
            f"{r['ms']:.2f} ms, {r['tokens_per_s']:.0f} tok/s")
    b = min(64, max(batches))
    for guided in (False, True):
        t = time_engine_steps(model, model_dir, b, guided=guided, context=ns.context,
                              steps=ns.steps, graphs=graph)
        out[f"engine_b{b}_{'guided' if guided else 'unguided'}"] = {
            "ms": t["total"] * 1e3, "tokens_per_s": b / t["total"],
            **{k + "_ms": v * 1e3 for k, v in t.items()}}
        say(f"engine alone: whole step batch {b} guided={guided}: {t['total'] * 1e3:.2f} ms")
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def hf_generate(model_dir: Path, ns, device, dtype) -> dict:
    """transformers `generate` at batch 64 on the service's prompts, sampled at temperature 1:
    unconstrained, then with xgrammar's logits processor per schema family (one grammar per
    row, cycling the family's schemas). Output tok/s counts each row's tokens up to its EOS."""
    import torch
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM

    from bench.schemas.check import compile_schema
    from gateway.loadgen import _PROMPTS, load_schemas
    from grammar_service.vocab import load_vocab

    vocab = load_vocab(model_dir)
    eos = vocab.eos_token_ids[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype).to(device).eval()
    batch = ns.hf_batch
    encoded = [vocab.encode(_PROMPTS[i % len(_PROMPTS)]) for i in range(batch)]
    width = max(map(len, encoded))
    ids = torch.tensor([[eos] * (width - len(e)) + e for e in encoded], device=device)
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=device)
    compiler = xgr.GrammarCompiler(vocab.tokenizer_info())

    def run(processor) -> dict:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            seq = hf.generate(ids, attention_mask=mask, max_new_tokens=ns.max_tokens,
                              do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              eos_token_id=eos, pad_token_id=eos,
                              logits_processor=[processor] if processor else None)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        new = seq[:, width:].tolist()
        tokens = sum(row.index(eos) + 1 if eos in row else len(row) for row in new)
        return {"batch": batch, "seconds": seconds, "tokens": tokens,
                "tokens_per_s": tokens / seconds, "steps": len(new[0])}

    torch.manual_seed(0)
    run(None)  # warm-up
    out = {"hf_unconstrained": run(None)}
    say(f"HF generate batch {batch} unconstrained: {out['hf_unconstrained']}")
    for family in ns.bases:
        schemas = load_schemas(family)
        grammars = [compile_schema(compiler, s) for s in schemas]
        proc = xgr.contrib.hf.LogitsProcessor([grammars[i % len(grammars)] for i in range(batch)])
        out[f"hf_xgrammar_{family}"] = run(proc)
        say(f"HF generate batch {batch} + xgrammar ({family}): {out[f'hf_xgrammar_{family}']}")
    hf.to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------- the table

def _ms(d: dict, p: str) -> str:
    return f"{d[p] * 1e3:.1f}"


def table(rows: list[dict], alone: dict, hf: dict, client: dict) -> str:
    """One markdown table: service rows, then the engine-alone and HF rows."""
    head = ("| concurrency | family | guided | shortcuts | output tok/s | req/s | "
            "TTFT p50 / p99 ms | inter-token p50 / p99 ms | tok/delta | errors | schema-valid | "
            "service eff. | guided ÷ unguided | ÷ HF | forced share | mask fills / out tok | "
            "steps / out tok | drafts kept / out tok | CPU cores gateways Σ / max / rank 0 |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    # guided ÷ unguided against the unguided run of the same shortcuts setting and round
    plain = {(r["concurrency"], r.get("shortcuts"), r.get("round", 1)):
             r["output_tokens_per_second"] for r in rows if r["ratio"] == 0 and "twin" not in r}
    rounds = max((r.get("round", 1) for r in rows), default=1)
    hf_plain = hf.get("hf_unconstrained", {}).get("tokens_per_s")
    for r in rows:
        tps = r["output_tokens_per_second"]
        engine = alone.get(f"decode_b{r['concurrency']}", {}).get("tokens_per_s")
        eff = f"{tps / engine:.2f}" if engine else "–"
        base = plain.get((r["concurrency"], r.get("shortcuts"), r.get("round", 1)))
        ratio_g = f"{tps / base:.2f}" if r["ratio"] > 0 and base else "–"
        w = r.get("worker", {})
        shares = " | ".join(f"{w[k]:.3f}" if k in w else "–" for k in
                            ("forced_share", "fills_per_token", "steps_per_token",
                             "draft_accepted_per_token"))
        ref = hf_plain if r["ratio"] == 0 else (
            hf.get(f"hf_xgrammar_{r['family']}", {}).get("tokens_per_s")
            if r["ratio"] == 1.0 else None)
        vs_hf = f"{tps / ref:.2f}" if ref else "–"
        valid = r["schema_valid_rate"]
        setting = r.get("shortcuts", "on") + (f" r{r.get('round', 1)}" if rounds > 1 else "")
        lines.append(
            f"| {r['concurrency']} | {r['family']} | {r['ratio']:.0%} | "
            f"{setting} | {tps:,.0f} | "
            f"{r['requests_per_second']:.1f} | {_ms(r['ttft_seconds'], 'p50')} / "
            f"{_ms(r['ttft_seconds'], 'p99')} | {_ms(r['inter_token_seconds'], 'p50')} / "
            f"{_ms(r['inter_token_seconds'], 'p99')} | {r['tokens_per_delta']:.2f} | "
            f"{sum(r['errors'].values())} {r['errors'] or ''} | "
            f"{'–' if valid is None else f'{valid:.3f}'} | {eff} | {ratio_g} | {vs_hf} | "
            f"{shares} | "
            f"{r['cpu_cores'].get('gateways_sum', '–')} / "
            f"{r['cpu_cores'].get('gateways_max', '–')} / {r['cpu_cores'].get('rank0', '–')} |")
    blank = " – | – | – | – | – | – | – | – | – | – | – | – | – | – |"
    for key, value in alone.items():
        what = (f"engine alone, decode step {value['ms']:.2f} ms" if key.startswith("decode")
                else f"engine alone, whole step {value['ms']:.2f} ms")
        b = re.search(r"b(\d+)", key).group(1)
        guided = "100%" if key.endswith("_guided") else "0%"
        lines.append(f"| {b} | {what} | {guided} | on | {value['tokens_per_s']:,.0f} |{blank}")
    for key, value in hf.items():
        fam = key.removeprefix("hf_xgrammar_") if "xgrammar" in key else "-"
        what = "HF generate" + (f" + xgrammar ({fam})" if fam != "-" else "")
        lines.append(f"| {value['batch']} | {what} | {'0%' if fam == '-' else '100%'} | – | "
                     f"{value['tokens_per_s']:,.0f} |{blank}")
    if client:
        lines.append(f"| {max(r['concurrency'] for r in rows) if rows else '–'} | load generator "
                     f"alone (fake gateways) | 0% | – | {client['output_tokens_per_second']:,.0f} |"
                     f"{blank}")
    return "\n".join(lines + settings_ratios(rows) + twin_ratios(rows))


def settings_ratios(rows: list[dict]) -> list[str]:
    """Lines 'shortcuts <setting> ÷ off', 'on ÷ no-drafts', 'drafts4 ÷ on' (and '<setting> ÷
    <setting>@base': this code over the base tree's) per run measured under both: output
    tokens/s of the same round, interleaved, and their median over rounds."""
    tps = {(r["concurrency"], r["family"], r["ratio"], r.get("shortcuts"), r.get("round", 1)):
           r["output_tokens_per_second"] for r in rows}
    present = dict.fromkeys(k[3] for k in tps)
    compared = [(s, "off") for s in SHORTCUTS if s != "off"] + [("on", "no-drafts"),
                                                                  ("drafts4", "on")]
    compared += [(s.removesuffix("@base"), s) for s in present if s and s.endswith("@base")]
    compared += [(s, s.partition("*")[0]) for s in present if s and "*" in s]
    out = []
    for setting, ref in compared:
        for c, fam, ratio in dict.fromkeys(k[:3] for k in tps):
            pairs = [tps[(c, fam, ratio, setting, n)] / tps[(c, fam, ratio, ref, n)]
                     for (c2, f2, r2, s, n) in tps if (c2, f2, r2, s) == (c, fam, ratio, setting)
                     and tps.get((c, fam, ratio, ref, n))]
            if pairs:
                each = ", ".join(f"{x:.2f}" for x in pairs)
                out.append(f"shortcuts {setting} ÷ {ref}, c={c} {fam} {ratio:.0%} guided: "
                           f"{statistics.median(pairs):.2f} (rounds: {each})")
    return ["", *out] if out else []


def twin_ratios(rows: list[dict]) -> list[str]:
    """Lines 'guided ÷ unguided twin' per guided run with a twin (--twins): output tokens/s
    of the guided run over its twin's, same round and setting, and their median."""
    tps = {(r["concurrency"], r["family"], r.get("shortcuts"), r.get("round", 1)):
           r["output_tokens_per_second"] for r in rows}
    pairs: dict[tuple, list[float]] = {}
    for r in rows:
        if "twin" in r and r["output_tokens_per_second"]:
            fam = r["family"].removesuffix(" twin")
            key = (r["concurrency"], fam, r.get("shortcuts"))
            guided = tps.get((r["concurrency"], fam, r.get("shortcuts"), r.get("round", 1)))
            if guided:
                pairs.setdefault(key, []).append(
                    (guided / r["output_tokens_per_second"], r["twin"]))
    out = [f"guided ÷ unguided twin (the same requests without their grammar, the guided "
           f"answers' mean length, ignore_eos), c={c} {fam} shortcuts {setting}: "
           f"{statistics.median(x for x, _ in v):.2f} (rounds: "
           f"{', '.join(f'{x:.2f} at {n} tokens' for x, n in v)})"
           for (c, fam, setting), v in pairs.items()]
    return ["", *out] if out else []


# ------------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke test: tiny shape, the default model's tokenizer, 8 slots, "
                        "concurrency 4, few requests, no HF")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer.json (150k BPE)")
    p.add_argument("--train-tokenizer", action="store_true",
                   help="train the tokenizer into --tokenizer (default .bench/tok150k.json) "
                        "when that file does not exist")
    p.add_argument("--train-only", action="store_true", help="stop after training")
    p.add_argument("--check-schemas", action="store_true",
                   help="print tokens per answer of each family under a random sampler; exit")
    p.add_argument("--out", type=Path, default=None, help="directory for serve.txt/json")
    p.add_argument("--concurrency", default="64,256")
    p.add_argument("--ratios", default="0,0.2,0.8,1.0")
    p.add_argument("--families", default="short,long",
                   help="schema families of bench/schemas/, each optionally with request "
                        "options: name[@backend][@fixed] (fixed: the schemas' own property "
                        "order), e.g. long,long@fixed,long@xgrammar")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--backend", default="auto", choices=BACKEND_NAMES,
                   help="grammar backend the guided requests ask for (a run's family may name "
                        "another: long@xgrammar). auto, the product's default, takes "
                        "llguidance for these schemas, with any property order; HF runs "
                        "xgrammar")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per run")
    p.add_argument("--requests", type=int, default=0, help="instead of --duration")
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--gateways", type=int, default=4,
                   help="gateway processes sharing the port (gramserve up --gateways)")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--client-processes", type=int, default=4)
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--context", type=int, default=64, help="engine-alone context per row")
    p.add_argument("--steps", type=int, default=30, help="engine-alone timed steps")
    p.add_argument("--hf-batch", type=int, default=64)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-engine-alone", action="store_true",
                   help="skip the engine-alone rows (the service runs only)")
    p.add_argument("--client-servers", type=int, default=4,
                   help="fake-gateway processes for the load generator's own ceiling (0: skip)")
    p.add_argument("--profile", default="",
                   help="runs to sample with py-spy, as c:family:ratio[,...] (e.g. 256:-:0; a "
                        "guided run's twin is sampled with it)")
    p.add_argument("--profile-gil", action="store_true",
                   help="also sample each process's threads only while they hold the GIL "
                        "(pyspy-<name>-<role>-gil.txt): against the wall-clock profile, "
                        "the time a thread waits for the GIL")
    p.add_argument("--shortcuts", default="on,off",
                   help="worker forced tokens, accept-first and drafts, one stack per "
                        "setting: on (the worker's defaults), off, forced (forced tokens "
                        "only), accept-first (accept-first only), no-drafts (both, no drafts: "
                        "--draft-tokens 0), drafts4 (all on, --draft-tokens 4), every-round "
                        "(all on, every forced chain followed at once: --forced-round-cost 0), "
                        "comma-separated; a setting ending in @base "
                        "runs the code of --base-tree, one with *N (e.g. on*2) N worker "
                        "groups on the GPU (one engine process each; worker metrics summed "
                        "over the groups); stacks after the first run --variant-runs")
    p.add_argument("--base-tree", type=Path, default=None,
                   help="another checkout of the project (e.g. `git worktree add DIR "
                        "COMMIT`) whose code the @base settings' stacks run, up beside the "
                        "others and interleaved with them: code against code in one run")
    p.add_argument("--variant-runs", default="64:-:0,64:short:1,64:long:1,256:long:1",
                   help="c:family:ratio runs of the second --shortcuts setting")
    p.add_argument("--rounds", type=int, default=1,
                   help="times each run is made; the settings' stacks are all up at once and "
                        "their runs interleave, the order alternating by round")
    p.add_argument("--train-steps", type=int, default=0,
                   help="fine-tune the checkpoint on the schemas first (bench/train_json.py), "
                        "at most this many steps; guided prompts then name their schema")
    p.add_argument("--twins", action="store_true",
                   help="after each 100%% guided run, its unguided twin: the same requests "
                        "without their grammar, each as long as the guided answers were on "
                        "average (gramserve bench --unguided-twin)")
    p.add_argument("--client-check-only", action="store_true",
                   help="only measure the load generator against fake gateways; exit")
    ns = p.parse_args(argv)
    if ns.tiny:
        # The smoke test's sizes, except where given (a host-bound whole-stack run on a CPU:
        # --tiny --slots 64 --concurrency 64 --duration 10).
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        ns.device, ns.no_hf, ns.client_processes = "cpu", True, 1
        ns.slots = ns.slots if "--slots" in given else 8
        ns.concurrency = ns.concurrency if "--concurrency" in given else "4"
        if "--duration" not in given:
            ns.duration, ns.requests = 0.0, ns.requests or 12
        ns.steps, ns.context, ns.max_tokens = 5, 16, min(ns.max_tokens, 32)
        ns.client_servers = min(ns.client_servers, 1)
    ns.concurrency = [int(c) for c in str(ns.concurrency).split(",")]
    ns.ratios = [float(r) for r in ns.ratios.split(",")]
    ns.families = ns.families.split(",")
    ns.profile = set(filter(None, ns.profile.split(",")))
    ns.shortcuts = ns.shortcuts.split(",")
    if not ns.shortcuts or not all(
            split_setting(s)[0] in SHORTCUTS and split_setting(s)[1] >= 1
            and s.partition("@")[2] in ("", "base")
            for s in ns.shortcuts) or len(set(ns.shortcuts)) < len(ns.shortcuts):
        raise SystemExit(f"--shortcuts: comma-separated settings of {', '.join(SHORTCUTS)}, "
                         "each optionally with *N (N worker groups), "
                         "each once, optionally with @base")
    if any(s.endswith("@base") for s in ns.shortcuts):
        if ns.base_tree is None or not (ns.base_tree / "gateway" / "cli.py").is_file():
            raise SystemExit("--shortcuts ...@base needs --base-tree DIR, a checkout of the "
                             "project")
        ns.base_tree = ns.base_tree.resolve()
    ns.variant_runs = [(int(c), f, float(r)) for c, f, r in
                       (item.split(":") for item in ns.variant_runs.split(",") if item)]
    try:  # the schema families themselves, for training, HF and --check-schemas
        ns.bases = list(dict.fromkeys(grammar_variant(f, ns.backend)[0] for f in ns.families))
        for _, family, _ in ns.variant_runs:
            if family != "-":
                grammar_variant(family, ns.backend)
    except ValueError as exc:
        raise SystemExit(f"--families / --variant-runs: {exc}") from None
    if ns.tokenizer is None and ns.train_tokenizer:
        ns.tokenizer = ROOT / ".bench" / "tok150k.json"
    return ns


def main(argv=None) -> int:
    ns = parse_args(argv)
    if ns.train_tokenizer and not ns.tokenizer.is_file():
        say(f"training a 151k byte-level BPE into {ns.tokenizer}")
        train_tokenizer(ns.tokenizer)
        say(f"tokenizer written: {ns.tokenizer.stat().st_size / 1e6:.1f} MB")
    if ns.train_only:
        return 0
    if ns.device == "cpu":  # the worker's Triton kernels run interpreted on the CPU
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if ns.client_check_only:
        for c in ns.concurrency:
            r = client_check(ns, c, max(1, ns.client_servers))
            say(f"load generator vs {ns.client_servers} fake gateways, concurrency {c}: "
                f"{r['output_tokens_per_second']:,.0f} tok/s, errors {r['errors']}, "
                f"tokens/delta {r['tokens_per_delta']:.2f}")
        return 0
    if ns.check_schemas:
        from bench.schemas.check import report

        if ns.tokenizer is None:
            raise SystemExit("--check-schemas needs --tokenizer (or --train-tokenizer)")
        report(ns.tokenizer, ns.bases, samples=50)
        return 0
    if ns.tokenizer is None and not ns.tiny:
        raise SystemExit("--tokenizer PATH (or --train-tokenizer) is required without --tiny")
    out = ns.out = ns.out or Path(tempfile.mkdtemp(prefix="serve-"))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="serve-model-") as tmp:
        return run_all(ns, Path(tmp), out)


def run_all(ns, model_dir: Path, out: Path) -> int:
    import torch

    from bench.step import QWEN25_05B, TINY, add_tokenizer, write_checkpoint
    from grammar_service.default_model import ensure_default_model
    from grammar_service.vocab import load_vocab

    raw: list[str] = []

    def say_line(msg: str) -> None:
        say(msg)
        raw.append(msg)

    device = torch.device(ns.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = ns.tokenizer or ensure_default_model() / "tokenizer.json"
    shape = dict(QWEN25_05B)
    if ns.tiny:
        from tokenizers import Tokenizer

        n = Tokenizer.from_file(str(tokenizer)).get_vocab_size(with_added_tokens=True)
        shape = dict(TINY, vocab_size=math.ceil(n / 64) * 64)
    say(f"writing a random-weight {'tiny' if ns.tiny else 'Qwen2.5-0.5B'}-shaped checkpoint "
        f"({dtype}) to {model_dir}")
    hf = write_checkpoint(model_dir, shape, dtype, torch.device("cpu"))
    del hf
    add_tokenizer(model_dir, tokenizer)
    vocab = load_vocab(model_dir)  # what the stack will load: fails here, not in a child
    say_line(f"vocabulary {vocab.vocab_size} tokens, model vocabulary {vocab.model_vocab_size}, "
             f"eos {vocab.eos_token_ids}, tokenizer {tokenizer}")
    trained = {}
    if ns.train_steps:
        from bench.train_json import train

        trained = train(model_dir, ns.bases, steps=ns.train_steps, log=say_line)
        say_line(f"fine-tuned on the schemas: {trained}")
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               GRAMSERVE_CUDA_GRAPH_MAX_BATCH=str(ns.slots))
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]
    args = ["--device", ns.device, "--tp", "1", "--slots", str(ns.slots),
            "--gateways", str(ns.gateways),
            "--model", str(model_dir), "--port", "0", "--metrics-port", "0", "--http-port", "-1",
            "--max-model-len", str(ns.max_model_len),
            "--max-queue", str(max(64, 2 * max(ns.concurrency))),
            "--startup-timeout", str(ns.startup_timeout)]
    rows, alone, hf, client = [], {}, {}, {}
    if ns.client_servers:
        try:
            c = max(ns.concurrency)
            client = client_check(ns, c, ns.client_servers)
            say_line(f"load generator alone vs {ns.client_servers} fake gateways, concurrency "
                     f"{c}: {client['output_tokens_per_second']:,.0f} tok/s, "
                     f"errors {client['errors']}")
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            say_line(f"client check failed: {exc}")
    # Every --shortcuts setting has its own stack, all up at once on the one device; their
    # runs interleave (the order of the settings alternates by round), so a difference
    # between settings is not a difference between minutes of the device or host.
    stacks: dict[str, Stack] = {}
    plans: dict[str, list] = {}
    try:
        for shortcuts in ns.shortcuts:
            # The worker's --forced-tokens / --accept-first, through their GRAMSERVE_ variables.
            setting, groups, tree = split_setting(shortcuts)
            forced, accept_first, round_cost, drafts = SHORTCUTS[setting]
            variant_env = dict(env, GRAMSERVE_FORCED_TOKENS=str(int(forced)),
                               GRAMSERVE_ACCEPT_FIRST=str(int(accept_first)))
            if round_cost is not None:
                variant_env["GRAMSERVE_FORCED_ROUND_COST"] = str(round_cost)
            if drafts is not None:
                variant_env["GRAMSERVE_DRAFT_TOKENS"] = str(drafts)
            cwd = ROOT
            if tree:  # `python -m` puts its directory first on the path, then PYTHONPATH's
                cwd = ns.base_tree
                variant_env["PYTHONPATH"] = os.pathsep.join(
                    filter(None, [str(cwd), os.environ.get("PYTHONPATH")]))
            plans[shortcuts] = (matrix_plan(ns) if shortcuts == ns.shortcuts[0]
                                else ns.variant_runs)
            log = out / f"stack-{shortcuts.replace('@', '-').replace('*', 'x')}.log"
            stack = stacks[shortcuts] = Stack(args + ["--groups", str(groups)], variant_env,
                                              log, cwd)
            say(f"starting the stack (forced tokens and accept-first {shortcuts})")
            addr = stack.start(ns.startup_timeout + 30)
            say_line(f"stack up at {addr} (shortcuts {shortcuts}); metrics {stack.metrics}")
            c = max(ns.concurrency)
            # compiles every schema (under each run's options), captures the decode graphs
            for family in dict.fromkeys(f for _, f, _ in plans[shortcuts] if f != "-"):
                warm = run_load(addr, c, family, 0.5, ns, duration=0, requests=c,
                                schema_prompts=bool(ns.train_steps))
                say_line(f"warm-up c={c} {family}: {warm['ok']}/{warm['requests']} ok, "
                         f"{warm['output_tokens_per_second']:.0f} tok/s, errors {warm['errors']}")
        for rnd, run, shortcuts in interleave(plans, ns.rounds):
            stack = stacks[shortcuts]
            rows += run_matrix(stack.addr, stack, ns, say_line, [run], shortcuts, rnd)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        say_line(f"load runs failed: {exc}")
    finally:
        for shortcuts, stack in stacks.items():
            say(f"stopping the stack (shortcuts {shortcuts})")
            stack.stop()
    try:
        if not ns.no_engine_alone:
            engine_alone(model_dir, ns, device, dtype, alone)
    except Exception as exc:  # keep the service rows and what was measured
        say_line(f"engine alone failed: {type(exc).__name__}: {exc}")
    if not ns.no_hf:
        try:
            hf = hf_generate(model_dir, ns, device, dtype)
        except Exception as exc:
            say_line(f"HF generate failed: {type(exc).__name__}: {exc}")
    text = table(rows, alone, hf, client)
    if trained:
        text += (f"\n\nModel fine-tuned on the schemas (bench/train_json.py): {trained['steps']} "
                 f"steps in {trained['seconds']:.0f} s; greedy answers without a grammar "
                 f"schema-valid {trained['valid_before']:.2f} before, "
                 f"{trained.get('valid', 0):.2f} after.")
    env_line = (f"# device={torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
                f" torch={torch.__version__} shape={'tiny' if ns.tiny else 'qwen2.5-0.5b'} "
                f"dtype={dtype} slots={ns.slots} max_model_len={ns.max_model_len} "
                f"max_tokens={ns.max_tokens} duration={ns.duration}s per run "
                f"weights={'fine-tuned' if ns.train_steps else 'random'} "
                f"tokenizer={vocab.vocab_size} tokens")
    print(env_line + "\n" + text, flush=True)
    (out / "serve.txt").write_text(env_line + "\n" + text + "\n\n" + "\n".join(raw) + "\n")
    (out / "serve.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(ns).items()}, "runs": rows,
         "engine_alone": alone, "hf": hf, "client_check": client, "trained": trained},
        indent=1))
    say(f"wrote {out / 'serve.txt'} and {out / 'serve.json'}")
    return 0 if rows and all(not r["errors"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
