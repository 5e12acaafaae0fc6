"""Real-world JSON schemas through gramserve's compile path: gramserve's choice vs each backend.

    PYTHONPATH=$PWD python bench/grammars.py --schemastore GIT_DIR [--tokenizer tok.json]
        [--limit N] [--timeout S] [--jobs N] [--out FILE]
    PYTHONPATH=$PWD python bench/grammars.py --schemastore GIT_DIR [--limit N]
        --export-corpus corpus.json
    PYTHONPATH=$PWD python bench/grammars.py --corpus corpus.json [--limit N] [--jobs N] ...

The corpus: SchemaStore (https://github.com/SchemaStore/schemastore, Apache-2.0; read from
a clone or bare mirror at --schemastore, the commit is printed): every schema of
src/schemas/json/ under --max-schema-bytes that has instances in src/test/<name>/ or
src/negative_test/<name>/ (JSON, YAML or TOML files), --limit of them evenly spaced in
name order.
--export-corpus FILE writes that selection to FILE as JSON ({"source", "url", "commit",
"schemas": [{name, schema, instances: [[data, valid], ...]}]}) and exits without measuring;
--corpus FILE reads such a file instead of --schemastore (for a machine without a clone;
--limit then takes an evenly spaced subset of the file's schemas, in its order).
Nothing of it is copied into this repository. An instance's validity is jsonschema's verdict
with the format checker (gramserve's output check, gateway/validation.py), not the folder
it came from; instances jsonschema cannot judge (e.g. a remote $ref) are dropped.

Each schema is compiled in three modes (bench/schema_verdicts.py: gramserve's choice,
xgrammar forced, llguidance forced), and by llguidance alone as the reference of what
compiling costs without gramserve (llguidance-raw: its own JSON front end, default options,
one build; --modes picks columns), in a worker process with a deadline per compile
(--timeout, the grammar service's own default is 30 s; a compile past it counts as a
timeout and the worker is restarted), and every instance is fed token by token, each mask
filled into a one-row bitmask and timed. Printed per mode: schemas passing (compiled, every
valid instance accepted, every invalid one refused), compile refusals and timeouts, valid
instances rejected, invalid instances accepted (reported unenforced at compile / silent),
compile p50/p99/max (validation + compile + serialise + the rank's deserialise and first
matcher: the path to a request's first mask; and the p50 of each side, the grammar service's
and the rank's; llguidance alone counts all of it as the service's) and mask p50/p99 (one
row, one thread).

Each mode runs in worker processes of its own, one mode after another: a process that timed
xgrammar's compiles (seconds and hundreds of MB on some schemas) would carry their heap into
the next mode's timings. --jobs N runs N worker processes per mode at once, each taking
schemas from a shared queue (each worker with its own deadline and restarts); results are
reported in the corpus's order, so the table is that of --jobs 1 but for the timings.
Timings are per process, one thread each: keep N at or below half the cores, or the
compiles and masks compete for them (and for the deadline).

With --tokenizer (e.g. .bench/tok150k.json, a byte-level BPE from bench/serve.py
--train-tokenizer), the vocabulary is that tokenizer's; otherwise the default model's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import queue
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.schema_verdicts import MODES, RAW_LLGUIDANCE  # noqa: E402

# Every column the table can print: gramserve's three paths, then llguidance alone.
ALL_MODES = (*MODES, RAW_LLGUIDANCE)

# ------------------------------------------------------------------------------ the corpus

def _git(git_dir: str, *args: str) -> str:
    return subprocess.check_output(["git", "--git-dir", git_dir, *args], text=True)


def _parse(ext: str, text: str):
    if ext in ("yaml", "yml"):
        import yaml

        return yaml.safe_load(text)
    if ext == "toml":
        import tomllib  # Python 3.11+; on 3.10 TOML instances are dropped

        return tomllib.loads(text)
    return json.loads(text)


def load_corpus(git_dir: str, commit: str, limit: int, max_schema_bytes: int,
                max_instance_bytes: int) -> list[dict]:
    """[{name, schema, instances: [(data, valid)]}] from SchemaStore at `commit` (see the
    module docstring for the selection)."""
    import jsonschema

    listing = _git(git_dir, "ls-tree", "-r", "-l", commit, "src/schemas/json", "src/test",
                   "src/negative_test")
    schemas, instances = {}, {}
    for line in listing.splitlines():
        meta, path = line.split("\t", 1)
        size = meta.split()[3]
        if not size.isdigit():
            continue
        parts = path.split("/")
        if parts[1] == "schemas" and path.endswith(".json") and int(size) <= max_schema_bytes:
            schemas[parts[3][:-5]] = path
        elif parts[1] in ("test", "negative_test") and len(parts) == 4 \
                and int(size) <= max_instance_bytes:
            ext = parts[3].rsplit(".", 1)[-1]
            if ext in ("json", "yaml", "yml", "toml"):
                instances.setdefault(parts[2], []).append((path, ext))
    eligible = sorted(n for n in schemas if n in instances)
    eligible = _spread(eligible, limit)  # over the alphabet (families of versions sit together)
    corpus = []
    for name in eligible:
        try:
            schema = json.loads(_git(git_dir, "show", f"{commit}:{schemas[name]}"))
            cls = jsonschema.validators.validator_for(schema,
                                                      default=jsonschema.Draft7Validator)
            validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
        except Exception:  # noqa: BLE001 - not JSON, or no validator for it: not in the corpus
            continue
        judged = []
        for path, ext in instances[name]:
            try:
                data = _parse(ext, _git(git_dir, "show", f"{commit}:{path}"))
                json.dumps(data)  # YAML dates and the like are not JSON
                judged.append((data, validator.is_valid(data)))
            except Exception:  # noqa: BLE001 - unparsable, or jsonschema cannot judge it
                continue
        if judged and isinstance(schema, dict):
            corpus.append({"name": name, "schema": schema, "instances": judged})
    return corpus


def _spread(items: list, limit: int) -> list:
    """`limit` of `items`, evenly spaced (all of them when there are no more)."""
    if limit < len(items):
        items = [items[i * len(items) // limit] for i in range(limit)]
    return items


SCHEMASTORE_URL = "https://github.com/SchemaStore/schemastore"


def export_corpus(path: Path, commit: str, corpus: list[dict]) -> None:
    path.write_text(json.dumps({"source": "SchemaStore", "url": SCHEMASTORE_URL,
                                "commit": commit, "schemas": corpus}))


def read_corpus(path: Path, limit: int) -> tuple[str, list[dict]]:
    """(commit, corpus) from an --export-corpus file, `limit` schemas evenly spaced."""
    data = json.loads(path.read_text())
    return data["commit"], _spread(data["schemas"], limit)


def vocab_dir(tokenizer_json: Path) -> Path:
    """A checkpoint directory with only the vocabulary files of `tokenizer_json` (EOS
    <|endoftext|>, model vocabulary = tokenizer size rounded up to 64), under .bench/."""
    from tokenizers import Tokenizer

    out = ROOT / ".bench" / f"vocab-{tokenizer_json.stem}"
    if not (out / "config.json").is_file():
        tok = Tokenizer.from_file(str(tokenizer_json))
        out.mkdir(parents=True, exist_ok=True)
        (out / "tokenizer.json").write_text(tokenizer_json.read_text())
        size = tok.get_vocab_size(with_added_tokens=True)
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"eos_token": "<|endoftext|>", "add_bos_token": False}))
        (out / "config.json").write_text(json.dumps({
            "vocab_size": (size + 63) // 64 * 64,
            "eos_token_id": tok.token_to_id("<|endoftext|>")}))
    return out


def model_dir(tokenizer_json: Path | None) -> Path:
    """`vocab_dir(tokenizer_json)`, or the embedded default model's directory for None."""
    if tokenizer_json is not None:
        return vocab_dir(tokenizer_json)
    from grammar_service.default_model import ensure_default_model

    return ensure_default_model()


# ------------------------------------------------------------------------------ the worker

def _worker(model_dir: str, conn) -> None:
    """Serve (schema, instances, mode) jobs on a pipe until None; answers a result dict."""
    from bench.schema_verdicts import Judge
    from grammar_service.vocab import load_vocab

    judge = Judge(load_vocab(model_dir))
    conn.send("ready")
    while (job := conn.recv()) is not None:
        schema, instances, mode = job
        build = judge.build(schema, mode)
        masks: list[float] = []
        verdicts = [judge.verdict(build, data, valid, masks) for data, valid in instances]
        conn.send({"backend": build.backend, "error": build.error,
                   "unenforced": build.unenforced, "seconds": build.compile_s + build.build_s,
                   "service_seconds": build.compile_s, "rank_seconds": build.build_s,
                   "verdicts": verdicts, "masks": masks})


class Worker:
    """A worker process with a deadline per job; restarted after a job runs past it."""

    def __init__(self, model_dir: Path):
        self.model_dir = str(model_dir)
        self.proc = None
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(self.model_dir, child), daemon=True)
        self.proc.start()
        if not self.conn.poll(600) or self.conn.recv() != "ready":
            raise RuntimeError("the worker did not start")

    def run(self, job, timeout: float) -> dict | None:
        """The job's result, or None when it ran past `timeout` seconds or the worker died
        (e.g. out of memory); the worker is then replaced."""
        self.conn.send(job)
        if self.conn.poll(timeout):
            try:
                return self.conn.recv()
            except EOFError:
                pass
        self.proc.kill()
        self.proc.join()
        self._start()
        return None

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(10)


def run_all(corpus: list[dict], model_dir: Path, timeout: float, jobs: int,
            modes: tuple[str, ...] = ALL_MODES) -> list[list]:
    """Per schema of `corpus`, in its order: a row per mode of `modes` (None: timeout/crash).
    Each mode runs in worker processes of its own, one mode after another, so that one
    mode's compiles (xgrammar's take seconds and hundreds of MB on some schemas) leave
    nothing behind in the process that times another's; `jobs` workers per mode take
    schemas from a shared queue."""
    rows: list = [[None] * len(modes) for _ in corpus]
    start = time.perf_counter()
    for k, mode in enumerate(modes):
        todo: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(len(corpus)):
            todo.put(i)
        done = itertools.count(1)

        def serve(mode=mode, k=k, todo=todo, done=done) -> None:
            worker = Worker(model_dir)
            try:
                while True:
                    try:
                        i = todo.get_nowait()
                    except queue.Empty:
                        return
                    entry = corpus[i]
                    rows[i][k] = worker.run((entry["schema"], entry["instances"], mode),
                                            timeout)
                    if (n := next(done)) % 25 == 0:
                        print(f"# {mode}: {n}/{len(corpus)} schemas, "
                              f"{time.perf_counter() - start:.0f} s", file=sys.stderr,
                              flush=True)
            finally:
                worker.close()

        with ThreadPoolExecutor(jobs) as pool:
            for future in [pool.submit(serve) for _ in range(jobs)]:
                future.result()
    return rows


# ------------------------------------------------------------------------------ the report

def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def summarise(results: dict[str, list[dict | None]]) -> dict[str, dict]:
    """Per mode: the counts and percentiles the table prints."""
    out = {}
    for mode, rows in results.items():
        verdicts, compiles, masks, s = Counter(), [], [], Counter()
        service, rank = [], []
        for row in rows:
            if row is None:
                s["timeouts"] += 1
                continue
            if row["error"]:
                s["schemas_refused"] += 1
            else:
                compiles.append(row["seconds"])
                service.append(row["service_seconds"])
                rank.append(row["rank_seconds"])
                masks += row["masks"]
                s["backend_" + row["backend"]] += 1
            verdicts.update(row["verdicts"])
            if not row["error"] and all(v == "pass" for v in row["verdicts"]):
                s["passing"] += 1
        out[mode] = {**s, **verdicts, "schemas": len(rows),
                     "compile_ms": [1e3 * _pct(compiles, p) for p in (50, 99, 100)],
                     "split_ms": [1e3 * _pct(service, 50), 1e3 * _pct(rank, 50)],
                     "mask_us": [1e6 * _pct(masks, p) for p in (50, 99)],
                     "masks": len(masks)}
    return out


def table(summary: dict[str, dict]) -> str:
    rows = [
        ("schemas passing", lambda s: f"{s.get('passing', 0)} / {s['schemas']}"),
        ("compile refused: schemas", lambda s: str(s.get("schemas_refused", 0))),
        ("  their instances", lambda s: str(s.get("refused", 0))),
        ("compile timeouts / crashes", lambda s: str(s.get("timeouts", 0))),
        ("valid instances rejected", lambda s: str(s.get("valid_rejected", 0))),
        ("invalid accepted: reported", lambda s: str(s.get("invalid_reported", 0))),
        ("invalid accepted: SILENT", lambda s: str(s.get("invalid_silent", 0))),
        ("instances passing", lambda s: str(s.get("pass", 0))),
        ("compile p50 / p99 / max ms", lambda s: " / ".join(f"{v:.1f}" for v in s["compile_ms"])),
        ("  p50 service / rank ms", lambda s: " / ".join(f"{v:.1f}" for v in s["split_ms"])),
        ("mask p50 / p99 us", lambda s: " / ".join(f"{v:.1f}" for v in s["mask_us"])),
        ("masks timed", lambda s: str(s["masks"])),
        ("backend used (llg / xgr)", lambda s: f"{s.get('backend_llguidance', 0)} / "
                                                f"{s.get('backend_xgrammar', 0)}"),
    ]
    lines = [f"{'':<28}" + "".join(f"{m:>28}" for m in summary)]
    for label, cell in rows:
        lines.append(f"{label:<28}" + "".join(f"{cell(s):>28}" for s in summary.values()))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--schemastore", help="SchemaStore git dir (bare ok)")
    source.add_argument("--corpus", type=Path, help="a corpus from --export-corpus instead")
    parser.add_argument("--commit", default="HEAD", help="with --schemastore")
    parser.add_argument("--export-corpus", type=Path, default=None, metavar="FILE",
                        help="write the selected corpus to FILE as JSON and exit")
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--limit", type=int, default=300,
                        help="schemas (default 300), evenly spaced in name order (with "
                             "--corpus: in the file's order)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="worker processes at once (default 1; at most half the cores)")
    parser.add_argument("--max-schema-bytes", type=int, default=100_000)
    parser.add_argument("--max-instance-bytes", type=int, default=8_000)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per compile")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--silent", action="store_true", help="list silent acceptances")
    parser.add_argument("--modes", default=",".join(ALL_MODES),
                        help=f"columns, comma-separated (default all: {','.join(ALL_MODES)})")
    ns = parser.parse_args(argv)
    if ns.jobs < 1:
        parser.error("--jobs must be at least 1")
    modes = tuple(m for m in ns.modes.split(",") if m)
    if not modes or set(modes) - set(ALL_MODES):
        parser.error(f"--modes: a comma-separated subset of {','.join(ALL_MODES)}")

    if ns.corpus is not None:
        commit, corpus = read_corpus(ns.corpus, ns.limit)
    else:
        commit = _git(ns.schemastore, "rev-parse", ns.commit).strip()
        corpus = load_corpus(ns.schemastore, commit, ns.limit, ns.max_schema_bytes,
                             ns.max_instance_bytes)
    if ns.export_corpus is not None:
        export_corpus(ns.export_corpus, commit, corpus)
        print(f"SchemaStore {commit}: {len(corpus)} schemas written to {ns.export_corpus}")
        return 0
    model = model_dir(ns.tokenizer)
    start = time.perf_counter()
    results: dict[str, list] = {mode: [] for mode in modes}
    notes = []
    for entry, rows in zip(corpus, run_all(corpus, model, ns.timeout, ns.jobs, modes),
                           strict=True):
        for mode, row in zip(modes, rows, strict=True):
            results[mode].append(row)
            if row is not None and "invalid_silent" in row["verdicts"]:
                notes.append(f"silent: {mode} {row['backend']} {entry['name']}")
    n_inst = sum(len(e["instances"]) for e in corpus)
    n_valid = sum(v for e in corpus for _, v in e["instances"])
    from grammar_service.vocab import load_vocab

    vocab = load_vocab(model)
    report = (f"SchemaStore {commit}: {len(corpus)} schemas, {n_inst} instances "
              f"({n_valid} valid, {n_inst - n_valid} invalid per jsonschema + formats); "
              f"vocabulary {vocab.model_vocab_size} tokens; {ns.jobs} job(s) (worker processes, "
              f"timings per process, one thread each; keep jobs at or below half the cores); "
              f"timeout {ns.timeout:.0f} s; {time.perf_counter() - start:.0f} s in all\n"
              + table(summarise(results)))
    if ns.silent and notes:
        report += "\n\n" + "\n".join(notes)
    print(report)
    if ns.out:
        ns.out.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
