"""The engine's host work per output token, on the CPU, with a model that follows the schema.

    PYTHONPATH=$PWD python bench/engine_host.py [--requests 384] [--slots 64] [--rounds 3]
        [--draft-tokens 2] [--family long] [--profile DIR]

The guided step on the GPU is bound by the host (bench/serve.py: the engine thread's CPU time
is most of a guided step, the device waits for it), so what the engine's thread does per token
decides guided throughput. This runs the real engine (gpu_worker.control.engine.Engine, TP=1,
its slot table, matchers, draft tables, forced-token scan and sampler) on the CPU with the
embedded default model's tokenizer, and in place of the transformer a *follower*: for every
logits row it returns a row whose argmax is that row's next token of a valid instance of its
schema (what a model fine-tuned on the schemas writes, as bench/train_json.py makes one on the
GPU), so accept-first holds, the draft tables guess what earlier answers did, and the forward
itself costs next to nothing. Each answer is then asked again without its grammar (its twin:
the same tokens, ignore_eos, max_tokens = its length). Guided and twin runs alternate for
`--rounds`.

Printed per run: output tokens, engine steps, steps per output token, and the engine thread's
time per output token split by the step's phases (the engine's own timings: the forward call,
the commit (accept each token into its matcher, emit, finish, draft tables), the sampling
point, mask fills waited for) and the rest of the step (plan, lockstep, publish). The
sampling point here is the CPU's op-by-op path (fused sampling needs Triton on a GPU).
`--profile DIR` records the engine's thread with py-spy (raw stacks, one file per run) for
`bench/pyspy_diff.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.mask_batch import instance  # noqa: E402
from bench.schema_verdicts import Judge  # noqa: E402
from gateway.loadgen import load_schemas  # noqa: E402
from gpu_worker.control.engine import Engine, EngineConfig, Request  # noqa: E402
from gpu_worker.control.lockstep import ControlChannel  # noqa: E402
from gpu_worker.control.slots import SlotTable  # noqa: E402
from gpu_worker.guided.grammar_cache import GrammarHandle  # noqa: E402
from grammar_service.default_model import ensure_default_model  # noqa: E402
from grammar_service.vocab import load_vocab  # noqa: E402
from protos import common_pb2  # noqa: E402

# The follower's logit for the scripted token (every other is 0): far above any Gumbel noise
# a float32 uniform can give, so temperature-1 sampling takes it.
MARGIN = 64.0


class Follower:
    """Stands in for the model: `__call__(batch)` gives (O, V) float32 logits whose argmax
    at each output position is the next token of the row's script (its request's answer,
    then EOS). `engine` is set once built (the scripts are found through its runs)."""

    def __init__(self, vocab_size: int, eos: int):
        self.vocab_size = vocab_size
        self.eos = eos
        self.scripts: dict[str, list[int]] = {}
        self.engine: Engine | None = None

    def __call__(self, batch) -> torch.Tensor:
        index = batch.last_index
        positions = (batch.positions if index is None else batch.positions[index]).tolist()
        slots = (batch.token_slots if index is None else batch.token_slots[index]).tolist()
        runs = self.engine.runs
        nxt = []
        for p, slot in zip(positions, slots, strict=True):
            req = runs[slot].req
            script = self.scripts[req.request_id]
            k = p + 1 - len(req.prompt)
            nxt.append(script[k] if 0 <= k < len(script) else self.eos)
        logits = torch.zeros((len(nxt), self.vocab_size), dtype=torch.float32)
        logits[torch.arange(len(nxt)), torch.tensor(nxt)] = MARGIN
        return logits


def build_engine(vocab, slots: int, draft_tokens: int, max_model_len: int) -> tuple:
    device = torch.device("cpu")
    follower = Follower(vocab.model_vocab_size, vocab.eos_token_ids[0])
    table = SlotTable(slots, is_rank0=True, admit_timeout_s=600)
    outputs: list = []
    engine = Engine(
        EngineConfig(num_slots=slots, max_model_len=max_model_len, step_tokens=4 * slots,
                     idle_poll_s=0.0, cuda_graph_max_tokens=0, draft_tokens=draft_tokens),
        follower, table, ControlChannel(None, 1), vocab_size=vocab.vocab_size,
        model_vocab_size=vocab.model_vocab_size, eos_token_ids=vocab.eos_token_ids,
        device=device, publish=outputs.extend)
    follower.engine = engine
    return engine, table, follower, outputs


def answers(judge: Judge, schemas: list, n: int, rng: random.Random) -> list[tuple]:
    """(schema index, prompt tokens, answer tokens) of n requests: compact valid instances."""
    out = []
    for i in range(n):
        s = rng.randrange(len(schemas))
        text = json.dumps(instance(schemas[s], rng), separators=(",", ":"))
        out.append((s, judge.vocab.encode(f"answer {i} for schema {s}"),
                    judge.vocab.encode(text, add_special_tokens=False)))
    return out


def run(judge, builds, asked, ns, guided: bool, tag: str, profile: Path | None) -> dict:
    """Every request of `asked` through a fresh engine (guided, or as its twin); the engine
    thread's time by phase."""
    engine, table, follower, outputs = build_engine(judge.vocab, ns.slots, ns.draft_tokens,
                                                    ns.max_model_len)
    eos = judge.vocab.eos_token_ids[0]
    todo = deque()
    for i, (s, prompt, answer) in enumerate(asked):
        rid = f"{tag}-{i}"
        if guided:
            req = Request(request_id=rid, prompt=prompt, max_tokens=len(answer) + 8,
                          temperature=ns.temperature, seed=i)
            b = builds[s]
            req.matcher = judge.ranks[b.backend].new_matcher(b.grammar)
            req.grammar = GrammarHandle(f"schema-{s}", None, None, 0)
            follower.scripts[rid] = answer + [eos]
        else:
            req = Request(request_id=rid, prompt=prompt, max_tokens=len(answer),
                          temperature=ns.temperature, seed=i, ignore_eos=True)
            follower.scripts[rid] = list(answer)
        todo.append(req)
    spy = None
    if profile is not None:
        out = profile / f"pyspy-{tag}.txt"
        spy = subprocess.Popen([os.environ.get("PYSPY", "py-spy"), "record", "-p",
                                str(os.getpid()), "-r", os.environ.get("PYSPY_RATE", "250"), "--threads", "--idle", "-f",
                                "raw", "-o", str(out), "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # py-spy attaches
    phases = dict.fromkeys(("forward", "commit", "sample", "mask_fill_exposed", "total"), 0.0)
    live, tokens, steps = 0, 0, 0
    expected = {f"{tag}-{i}": a for i, (_, _, a) in enumerate(asked)}
    got: dict[str, list[int]] = {}
    while todo or live:
        while todo and table.in_use() < table.num_slots:
            req = todo.popleft()
            table.allocate(req.request_id, req)
            live += 1
        t = time.perf_counter()
        engine.step()
        spent = time.perf_counter() - t
        timings = engine.last_step_timings
        if timings.get("total"):
            steps += 1
            for k in phases:
                phases[k] += spent if k == "total" else timings.get(k, 0.0)
        for o in outputs:
            got.setdefault(o.req.request_id, []).extend(o.tokens)
            tokens += len(o.tokens)
            if o.finish is not None:
                live -= 1
        outputs.clear()
    if spy is not None:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        spy.wait(30)
    bad = sum(got.get(rid) != a for rid, a in expected.items())
    stats = engine.stats
    engine.stop()
    return {"tokens": tokens, "steps": steps, "phases": phases, "bad": bad,
            "drafted": stats["drafted"], "kept": stats["draft_accepted"],
            "resamples": stats["resamples"], "fills": stats["mask_fills"]}


def line(name: str, r: dict) -> str:
    per = {k: 1e6 * v / r["tokens"] for k, v in r["phases"].items()}
    rest = per["total"] - per["forward"] - per["commit"] - per["sample"] - per["mask_fill_exposed"]
    return (f"| {name} | {r['tokens']:,} | {r['steps']:,} | {r['tokens'] / r['steps']:.1f} | "
            f"{1e3 * r['phases']['total'] / r['steps']:.2f} | {per['total']:.1f} | "
            f"{per['forward']:.1f} | {per['commit']:.1f} | {per['sample']:.1f} | "
            f"{per['mask_fill_exposed']:.1f} | {rest:.1f} | {r['kept'] / r['tokens']:.2f} | "
            f"{r['resamples']} | {r['bad']} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="long")
    p.add_argument("--requests", type=int, default=384)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--draft-tokens", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the requests' temperature (greedy by default: the CPU's op-by-op "
                        "sampler at temperature 1 costs more than everything else here)")
    p.add_argument("--profile", type=Path, default=None,
                   help="directory for py-spy raw stacks of each run (py-spy on PATH or $PYSPY)")
    ns = p.parse_args(argv)
    torch.set_num_threads(1)
    vocab = load_vocab(ensure_default_model())
    judge = Judge(vocab)
    schemas = [json.loads(s) for s in load_schemas(ns.family)]
    builds = [judge.build(s, "gramserve", whitespace=common_pb2.WHITESPACE_COMPACT)
              for s in schemas]
    if not all(b.ok for b in builds):
        raise SystemExit("a schema does not compile")
    asked = answers(judge, schemas, ns.requests, random.Random(ns.seed))
    if ns.profile is not None:
        ns.profile.mkdir(parents=True, exist_ok=True)
    print(f"# engine on the CPU, follower model, {ns.family} family, {ns.requests} requests, "
          f"{ns.slots} slots, draft tokens {ns.draft_tokens}, vocabulary {vocab.vocab_size} "
          f"(backends: {sorted({b.backend for b in builds})}), torch threads 1")
    print("| run | output tokens | steps | tokens / step | ms / step | µs / token: step | "
          "forward | commit | sampling | fill waited | rest | drafts kept / token | "
          "resamples | answers not as scripted |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    per_token = {"guided": [], "twin": []}
    for rnd in range(1, ns.rounds + 1):
        order = ("guided", "twin") if rnd % 2 else ("twin", "guided")
        for kind in order:
            r = run(judge, builds, asked, ns, kind == "guided", f"{kind}-r{rnd}",
                    ns.profile if rnd == 1 else None)
            per_token[kind].append(r["phases"]["total"] / r["tokens"])
            print(line(f"{kind} r{rnd}", r), flush=True)
    g, t = (statistics.median(per_token[k]) for k in ("guided", "twin"))
    print(f"\nengine thread per output token (median of rounds): guided {1e6 * g:.1f} µs, "
          f"twin {1e6 * t:.1f} µs; guided ÷ twin tokens/s {t / g:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
