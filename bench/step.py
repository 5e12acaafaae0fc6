"""Decode step time of gramserve's model runtime, side by side with transformers' `generate`.

A random-weight checkpoint shaped like Qwen2.5-0.5B is written with transformers, so both
runtimes load the same weights. For each batch size: every slot is prefilled with a
`--context`-token prompt, then decode steps are timed eagerly and as CUDA-graph replays (one
graph per batch size, static input buffers), and transformers' greedy `generate` is timed on
the same prompts. Decode-only time for `generate` is (t(1 + T tokens) - t(1 token)) / T.

    PYTHONPATH=$PWD python bench/step.py                      # H200: the full table
    PYTHONPATH=$PWD python bench/step.py --device cpu --tiny  # quick CPU check of the script

With `--tokenizer tokenizer.json` (a byte-level BPE as large as the model's vocabulary, e.g.
150k tokens) it also times the engine's real step — control all-reduce, forward, mask fill on
a CPU thread, Triton mask apply, sampling, matcher accept — with every row guided by a JSON
schema against no row guided, side by side, and splits the guided step into forward / mask
fill (and the part of it not hidden behind the forward) / mask apply / sampling.

Building blocks for other benchmarks: `write_checkpoint`, `build_model`, `prefill`,
`time_decode_step` (its `after_forward` hook runs per step on the logits, e.g. mask + sample),
`time_hf_generate`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from gpu_worker.runtime.cuda_graphs import StepGraphs
from gpu_worker.runtime.loader import load_model
from gpu_worker.runtime.model import ForwardBatch, Transformer
from gpu_worker.runtime.parallel import TPGroup

QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                  max_position_embeddings=32768, tie_word_embeddings=True)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=1000, max_position_embeddings=2048,
            tie_word_embeddings=True)


def write_checkpoint(model_dir: Path, shape: dict, dtype: torch.dtype, device: torch.device):
    """Write a random-weight Qwen2 checkpoint of `shape` to `model_dir`; returns the
    transformers model (on `device`, eval mode) holding the same weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**shape)
    with torch.device(device):
        hf = Qwen2ForCausalLM(config).to(dtype).eval()
    hf.save_pretrained(model_dir, safe_serialization=True)
    return hf


def build_model(model_dir: Path, device: torch.device, dtype: torch.dtype, num_slots: int,
                max_len: int) -> Transformer:
    """Load gramserve's Transformer at TP=1 with a KV cache of `num_slots` x `max_len`."""
    model = load_model(model_dir, TPGroup(0, 1, None, device), dtype, device)
    model.allocate_kv_cache(num_slots, max_len)
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(model: Transformer, prompts: Tensor) -> float:
    """Prefill slot i with prompts[i] (batch, context) in one step; returns seconds."""
    device = model.tp.device
    batch = ForwardBatch.build(list(range(prompts.shape[0])), [0] * prompts.shape[0],
                               prompts.tolist(), device)
    _sync(device)
    t0 = time.perf_counter()
    model(batch)
    _sync(device)
    return time.perf_counter() - t0


def time_decode_step(model: Transformer, batch: int, *, context: int, steps: int = 30,
                     warmup: int = 5, graph: bool = False,
                     after_forward: Callable[[Tensor], None] | None = None) -> dict:
    """Median time of one decode step over slots 0..batch-1, each holding `context` tokens.

    Eager steps build their ForwardBatch each step, as the engine does; graph mode captures
    one step with static buffers (decode window fixed to the cache length) and replays it,
    copying the step's ids and positions in first. `after_forward(logits)` runs after each
    forward (inside the timed region). Each step ends with a device sync (the engine samples
    every step). Returns {"ms": median ms per step, "tokens_per_s": batch / median}.
    """
    device = model.tp.device
    slots = list(range(batch))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (warmup + steps, batch), generator=gen)
    if graph:
        run = _graph_runner(model, batch, context)
    else:
        def run(i: int, tokens: Tensor) -> Tensor:
            step = ForwardBatch.build(slots, [context + i] * batch,
                                      [[t] for t in tokens.tolist()], device)
            return model(step)
    times = []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        logits = run(i, ids[i])
        if after_forward is not None:
            after_forward(logits)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    return {"ms": median * 1e3, "tokens_per_s": batch / median}


def _graph_runner(model: Transformer, batch: int, context: int) -> Callable[[int, Tensor], Tensor]:
    # The engine's own graphs (slot attention, graphs keyed by token count).
    graphs = StepGraphs(model, batch, batch, scratch_slot=model.k_cache.shape[1] - 1)
    slots = list(range(batch))

    def run(i: int, tokens: Tensor) -> Tensor:
        return graphs.run(slots, [context + i] * batch, [[t] for t in tokens.tolist()])

    return run


def time_mixed_step(model: Transformer, batch: int, chunk: int, *, context: int,
                    steps: int = 30, warmup: int = 5) -> dict:
    """Median ms of a graphed step with `batch` decode rows plus one `chunk`-token prefill
    chunk (slot `batch`), against the same step without the chunk, from the engine's graphs.
    Returns {"decode_ms", "mixed_ms", "ratio"}."""
    device = model.tp.device
    graphs = StepGraphs(model, batch + chunk, batch + 1, scratch_slot=model.k_cache.shape[1] - 1)
    slots = list(range(batch))
    out = {}
    for name, extra in (("decode_ms", 0), ("mixed_ms", chunk)):
        times = []
        for i in range(warmup + steps):
            toks = [[7]] * batch + ([[5] * extra] if extra else [])
            ss = slots + ([batch] if extra else [])
            starts = [context] * batch + ([context // 2] if extra else [])
            _sync(device)
            t0 = time.perf_counter()
            graphs.run(ss, starts, toks)
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e3
    out["ratio"] = out["mixed_ms"] / out["decode_ms"]
    return out


def time_draft_step(model: Transformer, batch: int, drafts: int, *, context: int,
                    steps: int = 30, warmup: int = 5) -> float:
    """Median ms of a graphed step in which each of `batch` rows feeds 1 + `drafts` tokens
    and gets logits at each (a row verifying drafts, gpu_worker.guided.drafts), every output
    then sampled (the fused Gumbel-max): the device's cost of checking drafts."""
    from gpu_worker.sampling.sampler import SamplingBatch, sample

    device = model.tp.device
    width = 1 + drafts
    n = batch * width
    graphs = StepGraphs(model, n, n, scratch_slot=model.k_cache.shape[1] - 1)
    params = SamplingBatch.from_lists([1.0] * n, [0] * n, [1.0] * n, [0.0] * n, [1] * n,
                                      list(range(n)), device=device)
    slots, rows = list(range(batch)), [[7] * width] * batch
    times = []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        logits = graphs.run(slots, [context] * batch, rows, outputs=[width] * batch)
        sample(logits, params)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def time_hf_generate(hf, prompts: Tensor, new_tokens: int) -> dict:
    """Decode-only step time of transformers' greedy generate on `prompts` (batch, context)."""
    device = next(hf.parameters()).device
    prompts = prompts.to(device)

    def generate(n: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n,
                    min_new_tokens=n, do_sample=False, pad_token_id=0)
        _sync(device)
        return time.perf_counter() - t0

    generate(2)  # warm-up
    first = min(generate(1) for _ in range(2))
    full = generate(1 + new_tokens)
    step = max(full - first, 1e-9) / new_tokens
    return {"ms": step * 1e3, "tokens_per_s": prompts.shape[0] / step}


def launch_overhead_us(device: torch.device, n: int = 2000) -> float:
    """Host time per tiny kernel launch: eager decode is launch-bound, so this explains it."""
    x = torch.zeros(1, device=device)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    _sync(device)
    return (time.perf_counter() - t0) / n * 1e6


GUIDED_SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                   "tags": {"type": "array", "items": {"type": "string"}},
                   "notes": {"type": "string"}},
    "required": ["id", "name", "tags", "notes"],
}


def add_tokenizer(model_dir: Path, tokenizer_json: Path) -> None:
    """Make `model_dir` a servable checkpoint: its tokenizer files, EOS set to <|endoftext|>."""
    import json
    import shutil

    from tokenizers import Tokenizer

    shutil.copyfile(tokenizer_json, model_dir / "tokenizer.json")
    eos = Tokenizer.from_file(str(tokenizer_json)).token_to_id("<|endoftext|>")
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "add_bos_token": False}))
    config = json.loads((model_dir / "config.json").read_text())
    config.update(eos_token_id=eos, bos_token_id=None)
    (model_dir / "config.json").write_text(json.dumps(config))


def time_engine_steps(model: Transformer, model_dir: Path, batch: int, *, guided: bool,
                      context: int, steps: int, warmup: int = 5,
                      graphs: bool = True, profile=None,
                      fill_threads: int = 0) -> dict[str, float]:
    """Median per-phase seconds of the engine's decode step with `batch` running slots.

    Every request gets a `context`-token prompt and never ends (ignore_eos, guided by a schema
    whose strings never close under random weights), so every timed step decodes `batch` rows.
    """
    import json

    import xgrammar as xgr

    from gpu_worker.control.engine import Engine, EngineConfig, Request
    from gpu_worker.control.lockstep import ControlChannel
    from gpu_worker.control.slots import SlotTable
    from grammar_service.vocab import load_vocab

    vocab = load_vocab(model_dir)
    device = model.tp.device
    slots = model.k_cache.shape[1] - 1  # the last one is the CUDA graphs' scratch slot
    table = SlotTable(slots, is_rank0=True, admit_timeout_s=600)
    engine = Engine(EngineConfig(num_slots=slots, max_model_len=model.k_cache.shape[2],
                                 step_tokens=batch * context + slots, idle_poll_s=0.0,
                                 cuda_graph_max_tokens=max(slots, 64) if graphs else 0,
                                 mask_fill_threads=fill_threads),
                    model, table, ControlChannel(None, 1), vocab_size=vocab.vocab_size,
                    model_vocab_size=model.config.vocab_size, eos_token_ids=vocab.eos_token_ids,
                    device=device)
    compiled = None
    if guided:
        compiled = xgr.GrammarCompiler(vocab.tokenizer_info()).compile_json_schema(
            json.dumps(GUIDED_SCHEMA), any_whitespace=False)
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(0, vocab.vocab_size, (context,), generator=gen).tolist()
        req = Request(request_id=f"b{i}", prompt=prompt, max_tokens=10**6, temperature=1.0,
                      seed=i, ignore_eos=True)
        if compiled is not None:
            req.matcher = xgr.GrammarMatcher(compiled)
        table.allocate(req.request_id, req)
    rows = []
    while len(rows) < warmup + steps:
        if profile is not None and len(rows) == warmup:
            profile.__enter__()
        engine.step()
        if engine.runs and all(r.generated for r in engine.runs.values()):
            rows.append(dict(engine.last_step_timings))
    if profile is not None:
        profile.__exit__(None, None, None)
    assert len(engine.runs) == batch, "a request ended during the benchmark"
    for r in list(engine.runs.values()):
        engine._finish(r, "cancelled")
    keys = ("total", "forward", "mask_fill", "mask_fill_exposed", "mask_apply", "sample")
    return {k: statistics.median(row.get(k, 0.0) for row in rows[warmup:]) for k in keys}


def check_graph_matches_eager(model: Transformer, batch: int, context: int) -> float:
    """Max |logit difference| between a graph replay and the eager forward of the same
    decode step (slots in shuffled order, so the graph's gather path is exercised)."""
    device = model.tp.device
    slots = list(range(batch))[::-1]
    prompts = torch.randint(0, 1000, (batch, context), generator=torch.Generator().manual_seed(9))
    model(ForwardBatch.build(slots, [0] * batch, prompts.tolist(), device))
    tokens = list(range(1, batch + 1))
    eager = model(ForwardBatch.build(slots, [context] * batch, [[t] for t in tokens], device))
    graphs = StepGraphs(model, batch, batch, scratch_slot=model.k_cache.shape[1] - 1)
    replay = graphs.run(slots, [context] * batch, [[t] for t in tokens])
    return (eager - replay).abs().max().item()


def guided_table(model: Transformer, model_dir: Path, batches: list[int], context: int,
                 steps: int, graphs: bool) -> None:
    mode = "CUDA-graph decode" if graphs else "eager decode"
    print(f"\n## Engine step ({mode}), every row guided (JSON schema) vs no row guided")
    print("| batch | unguided ms | guided ms | guided/unguided | forward ms | mask fill ms | "
          "fill exposed ms | mask apply ms | sample ms (guided / unguided) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in batches:
        plain = time_engine_steps(model, model_dir, batch, guided=False, context=context,
                                  steps=steps, graphs=graphs)
        guided = time_engine_steps(model, model_dir, batch, guided=True, context=context,
                                   steps=steps, graphs=graphs)
        ms = {k: v * 1e3 for k, v in guided.items()}
        print(f"| {batch} | {plain['total'] * 1e3:.2f} | {ms['total']:.2f} | "
              f"{guided['total'] / plain['total']:.3f} | {ms['forward']:.2f} | "
              f"{ms['mask_fill']:.2f} | {ms['mask_fill_exposed']:.2f} | {ms['mask_apply']:.2f} | "
              f"{ms['sample']:.2f} / {plain['sample'] * 1e3:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--hf-tokens", type=int, default=32)
    parser.add_argument("--tiny", action="store_true", help="a tiny shape, for a CPU check")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="tokenizer.json for the guided vs unguided engine table")
    parser.add_argument("--skip-forward-table", action="store_true")
    parser.add_argument("--graphs-only", action="store_true",
                        help="time the engine step with CUDA graphs only (no eager table)")
    parser.add_argument("--fill-threads-sweep", action="store_true",
                        help="also time the guided step with several mask-fill thread counts")
    parser.add_argument("--drafts-table", action="store_true",
                        help="CUDA: the graphed step with 0, 1, 2, 4 drafted tokens per row")
    parser.add_argument("--profile", action="store_true",
                        help="also print a torch.profiler table of the engine step")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches = [int(b) for b in args.batches.split(",")]
    shape = TINY if args.tiny else QWEN25_05B
    max_len = args.context + 64 + args.steps  # room for warm-up and timed steps
    with tempfile.TemporaryDirectory() as tmp:
        hf = write_checkpoint(Path(tmp), shape, dtype, device)
        # + a slot for a prefill chunk and the graphs' scratch slot
        model = build_model(Path(tmp), device, dtype, max(batches) + 2, max_len)
        if args.tokenizer is not None:
            add_tokenizer(Path(tmp), args.tokenizer)
            if device.type == "cuda":
                diff = check_graph_matches_eager(model, min(8, max(batches)), args.context)
                print(f"# graph replay vs eager forward: max |logit diff| = {diff:.3g}")
            modes = [True] if args.graphs_only else [True, False]
            for graphs in (modes if device.type == "cuda" else [False]):
                guided_table(model, Path(tmp), batches, args.context, args.steps, graphs)
        if args.fill_threads_sweep and args.tokenizer is not None:
            batch = max(batches)
            plain = time_engine_steps(model, Path(tmp), batch, guided=False,
                                      context=args.context, steps=args.steps)
            print(f"\n## Mask fill threads, batch {batch} (unguided step "
                  f"{plain['total'] * 1e3:.2f} ms)")
            print("| fill threads | guided ms | guided/unguided | mask fill ms | fill exposed ms |")
            print("|---|---|---|---|---|")
            for threads in (0, 8, 4, 2, 1):
                g = time_engine_steps(model, Path(tmp), batch, guided=True, context=args.context,
                                      steps=args.steps, fill_threads=threads)
                print(f"| {threads or 'auto'} | {g['total'] * 1e3:.2f} | "
                      f"{g['total'] / plain['total']:.3f} | {g['mask_fill'] * 1e3:.2f} | "
                      f"{g['mask_fill_exposed'] * 1e3:.2f} |", flush=True)
        if args.profile and args.tokenizer is not None:
            from torch.profiler import ProfilerActivity, profile

            for guided in (False, True):
                prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                time_engine_steps(model, Path(tmp), max(batches), guided=guided,
                                  context=args.context, steps=10, profile=prof)
                print(f"\n## Profile of 10 engine steps, batch {max(batches)}, guided={guided}")
                print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))
        if device.type == "cuda" and args.drafts_table:
            print(f"\n## Graphed step + sampling, each row feeding 1 + d tokens with logits at "
                  f"each (drafts), context {args.context}")
            print("| batch | d | tokens | step ms | ÷ d=0 | ms per token |")
            print("|---|---|---|---|---|---|")
            for batch in batches:
                base = None
                for d in (0, 1, 2, 4):
                    ms = time_draft_step(model, batch, d, context=args.context, steps=args.steps)
                    base = base or ms
                    print(f"| {batch} | {d} | {batch * (1 + d)} | {ms:.2f} | {ms / base:.2f} | "
                          f"{ms / (batch * (1 + d)) * 1e3:.1f} µs |", flush=True)
        if device.type == "cuda":
            print("\n## Graphed step: decode rows + one prefill chunk vs decode rows alone")
            print("| batch | chunk tokens | decode ms | mixed ms | mixed/decode |")
            print("|---|---|---|---|---|")
            for batch in batches:
                for chunk in (16, 64):
                    m = time_mixed_step(model, batch, chunk, context=args.context,
                                        steps=args.steps)
                    print(f"| {batch} | {chunk} | {m['decode_ms']:.2f} | {m['mixed_ms']:.2f} | "
                          f"{m['ratio']:.2f} |", flush=True)
        if args.skip_forward_table:
            return
    print(f"# device={torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'} "
          f"torch={torch.__version__} dtype={dtype} shape={'tiny' if args.tiny else 'qwen2.5-0.5b'} "
          f"context={args.context} steps={args.steps} "
          f"launch_overhead={launch_overhead_us(device):.1f}us/kernel")
    print("| batch | prefill s | eager ms | graph ms | graph tok/s | HF generate ms | "
          "HF tok/s | eager/HF | graph/HF |")
    print("|---|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        prompts = torch.randint(0, 1000, (batch, args.context), generator=gen)
        pre = prefill(model, prompts)
        eager = time_decode_step(model, batch, context=args.context, steps=args.steps)
        graph = {"ms": float("nan"), "tokens_per_s": float("nan")}
        if device.type == "cuda":
            try:
                graph = time_decode_step(model, batch, context=args.context, steps=args.steps,
                                         graph=True)
            except RuntimeError as exc:  # report and keep the eager and HF figures
                print(f"# batch {batch}: CUDA graph failed: {exc}", flush=True)
        ref = time_hf_generate(hf, prompts, args.hf_tokens)
        print(f"| {batch} | {pre:.3f} | {eager['ms']:.2f} | {graph['ms']:.2f} | "
              f"{graph['tokens_per_s']:.0f} | {ref['ms']:.2f} | {ref['tokens_per_s']:.0f} | "
              f"{eager['tokens_per_s'] / ref['tokens_per_s']:.2f} | "
              f"{graph['tokens_per_s'] / ref['tokens_per_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
