"""Attention time per layer: the model's SDPA paths side by side with the slot attention kernel.

(1) Decode: the model's batched decode attention as its CUDA graphs run it (gather a window of
W = max_len keys of every row's slot with index_select, then SDPA with a (B, 1, 1, W) mask;
the logic of `Attention._decode`, copied here so the bench outlives that path) against
`slot_attention`, at batch 64 and 256, contexts 128 / 512 / 1000, Qwen2.5-0.5B (14 heads,
2 KV heads, D 64) and 7B (28 heads, 4 KV heads, D 128) shapes. (2) Mixed steps: 64 decode
rows + one 64-token prefill chunk, and 64 decode rows + 4 chunks of 16 (the chunks continue a
prompt, ending at the decode context); the model path is its decode call plus one SDPA call
per chunk (`Attention._prefill`), timed eager (as the model runs mixed steps today) and in a
graph, against one `slot_attention` call.

Times are per layer: each timed call runs over `--layers` distinct layers of one cache buffer,
so the keys come from HBM as in a real forward, not from L2. On CUDA every path is captured
in a CUDA graph and replayed (eager mixed-step times use triton.testing.do_bench). GB/s
counts the bytes slot attention must read (K and V up to each row's context, q, out);
%copy compares it with a device-to-device copy. speedup = model time / ours.

    PYTHONPATH=$PWD python bench/attention.py [--sweep]         # H200: the full tables
    PYTHONPATH=$PWD python bench/attention.py --device cpu --tiny  # smoke run (interpreter)

Writes to stdout only. Imports neither protos nor grpc.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int


SHAPES = (Shape("qwen2.5-0.5b", 14, 2, 64), Shape("qwen2.5-7b", 28, 4, 128))
TINY_SHAPES = (Shape("tiny-0.5b-heads", 14, 2, 64), Shape("tiny-7b-heads", 28, 4, 128))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="small shapes (for the CPU)")
    parser.add_argument("--layers", type=int, default=None,
                        help="distinct cache layers per timed call (default 8, tiny 1)")
    parser.add_argument("--sweep", action="store_true",
                        help="also time launch configs (block, splits, warps) for decode")
    return parser.parse_args()


ARGS = parse_args()
if ARGS.device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402
from torch import Tensor  # noqa: E402

from gpu_worker.runtime import attention_kernel  # noqa: E402
from gpu_worker.runtime.attention_kernel import KernelConfig, slot_attention  # noqa: E402
from gpu_worker.runtime.attention_reference import slot_attention_reference  # noqa: E402


@dataclass
class Setup:
    """One benchmark's sizes: batches, decode contexts, cache length, layers, dtype, device."""

    device: torch.device
    dtype: torch.dtype
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    max_len: int
    layers: int
    shapes: tuple[Shape, ...]
    decode_rows_mixed: int
    chunk_plans: tuple[tuple[int, ...], ...]  # chunk lengths of each mixed step


def make_setup(args: argparse.Namespace) -> Setup:
    device = torch.device(args.device)
    if args.tiny:
        # The interpreter multiplies bfloat16 tl.dot operands as raw bits: float32 on the CPU.
        return Setup(device, torch.float32 if device.type == "cpu" else torch.bfloat16,
                     (2, 4), (8, 30), 64, args.layers or 1, TINY_SHAPES, 4, ((16,), (4, 4)))
    return Setup(device, torch.bfloat16, (64, 256), (128, 512, 1000), 1024, args.layers or 8,
                 SHAPES, 64, ((64,), (16, 16, 16, 16)))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_us(fn: Callable[[], None], device: torch.device, graph: bool = True) -> float:
    """Microseconds per call of `fn`: CUDA-graph replays (graph=True) or do_bench on CUDA,
    wall time of a few eager calls on the CPU."""
    if device.type != "cuda":
        fn()
        start = time.perf_counter()
        for _ in range(2):
            fn()
        return (time.perf_counter() - start) / 2 * 1e6
    if not graph:
        return triton.testing.do_bench(fn, warmup=20, rep=100) * 1e3
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # compile and warm up off the capture stream
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        fn()
    for _ in range(5):
        cuda_graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = 50
    start.record()
    for _ in range(replays):
        cuda_graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays * 1e3


def copy_bandwidth_gbs(device: torch.device) -> float | None:
    """Device-to-device copy of 2 GiB, bytes read + written per second; None off CUDA."""
    if device.type != "cuda":
        return None
    src = torch.empty(2**29, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=20, rep=200)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


# --- The model's current attention paths (copied from Attention._decode / _prefill) -------

def model_decode(q: Tensor, slots: Tensor, mask: Tensor, k_cache: Tensor, v_cache: Tensor,
                 window: int, scale: float) -> Tensor:
    # q: (B, H, hd); mask: (B, 1, 1, W); k_cache: (S, L, KV, hd). Returns (B, H * hd).
    b, heads, hd = q.shape
    kv_heads = k_cache.shape[2]
    q = q.view(b, kv_heads, heads // kv_heads, hd)  # (B, KV, G, hd)
    k = k_cache[:, :window].index_select(0, slots).transpose(1, 2)  # (B, KV, W, hd)
    v = v_cache[:, :window].index_select(0, slots).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, heads * hd)


def model_prefill(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    # q: (L, H, hd); k, v: (W, KV, hd) with W = start + L. Returns (L, H * hd).
    length, heads, hd = q.shape
    group = heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)  # (1, H, W, hd)
    v = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask,
                                         is_causal=mask is None, scale=scale)
    return out[0].transpose(0, 1).reshape(length, heads * hd)


def decode_mask(contexts: Tensor, window: int) -> Tensor:
    keys = torch.arange(window, device=contexts.device)
    return (keys < contexts.unsqueeze(1))[:, None, None, :]  # (B, 1, 1, W)


def prefill_mask(start: int, length: int, device: torch.device) -> Tensor | None:
    if start == 0:
        return None
    query = torch.arange(start, start + length, device=device).unsqueeze(1)  # (L, 1)
    return torch.arange(start + length, device=device) <= query  # (L, W)


# --- Problems ------------------------------------------------------------------------------

@dataclass
class Problem:
    """A cache of `layers` layers and one step's rows: decode rows first, then chunk rows."""

    q: Tensor  # (N, H, hd)
    k: Tensor  # (layers, S, L, KV, hd)
    v: Tensor
    token_slots: Tensor  # (N,) int64
    contexts: Tensor  # (N,) int64
    decode_rows: int
    chunks: list[tuple[int, int, int, int]]  # (row offset, slot, start, length)

    def bytes_read(self) -> int:
        kv_heads, hd = self.k.shape[3], self.k.shape[4]
        keys = int(self.contexts.sum())
        return (2 * keys * kv_heads * hd + 2 * self.q.numel()) * self.q.element_size()


def make_problem(setup: Setup, shape: Shape, decode_rows: int, context: int,
                 chunk_lens: tuple[int, ...] = ()) -> Problem:
    slots_needed = decode_rows + len(chunk_lens) + 1  # + a scratch slot, as the graphs have
    cache_shape = (setup.layers, slots_needed, setup.max_len, shape.kv_heads, shape.head_dim)
    gen = torch.Generator(device=setup.device).manual_seed(0)
    k = torch.randn(cache_shape, generator=gen, device=setup.device, dtype=setup.dtype)
    v = torch.randn(cache_shape, generator=gen, device=setup.device, dtype=setup.dtype)
    perm = torch.randperm(slots_needed, generator=torch.Generator().manual_seed(1)).tolist()
    slots, contexts, chunks = perm[:decode_rows], [context] * decode_rows, []
    for i, length in enumerate(chunk_lens):
        slot, start = perm[decode_rows + i], max(0, context - length)
        chunks.append((len(slots), slot, start, length))
        slots += [slot] * length
        contexts += list(range(start + 1, start + length + 1))
    n = len(slots)
    q = torch.randn(n, shape.heads, shape.head_dim, generator=gen, device=setup.device,
                    dtype=setup.dtype)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=setup.device)  # noqa: E731
    return Problem(q, k, v, as_tensor(slots), as_tensor(contexts), decode_rows, chunks)


def ours_fn(p: Problem, scale: float, config: KernelConfig | None = None) -> Callable[[], None]:
    out = torch.empty_like(p.q)
    group = p.q.shape[1] // p.k.shape[3]
    max_len = p.k.shape[2]

    def run() -> None:
        for layer in range(p.k.shape[0]):
            if config is None:
                slot_attention(p.q, p.k[layer], p.v[layer], p.token_slots, p.contexts,
                               scale=scale, out=out)
            else:
                attention_kernel._launch(p.q, p.k[layer], p.v[layer], p.token_slots,
                                         p.contexts, scale, max_len, out, group, config)
    return run


def model_fn(p: Problem, scale: float) -> Callable[[], None]:
    window = p.k.shape[2]  # the graphs' decode window: max_len
    d = p.decode_rows
    decode_slots = p.token_slots[:d]
    mask = decode_mask(p.contexts[:d], window)  # built once per step, shared by the layers
    chunk_masks = [prefill_mask(start, length, p.q.device) for _, _, start, length in p.chunks]
    decode_index = torch.arange(d, device=p.q.device)
    n, heads, hd = p.q.shape

    def run() -> None:
        for layer in range(p.k.shape[0]):
            kc, vc = p.k[layer], p.v[layer]
            if not p.chunks:
                model_decode(p.q, decode_slots, mask, kc, vc, window, scale)
                continue
            out = p.q.new_empty(n, heads * hd)
            out.index_copy_(0, decode_index, model_decode(
                p.q.index_select(0, decode_index), decode_slots, mask, kc, vc, window, scale))
            for (offset, slot, start, length), cmask in zip(p.chunks, chunk_masks, strict=True):
                out[offset:offset + length] = model_prefill(
                    p.q[offset:offset + length], kc[slot, :start + length],
                    vc[slot, :start + length], cmask, scale)
    return run


# --- Reports -------------------------------------------------------------------------------

def check_correctness(setup: Setup) -> None:
    """Kernel vs reference and vs the model's paths, on one problem per shape (and, on CUDA,
    bfloat16 compiled: the path the CPU tests cannot run)."""
    for shape in setup.shapes:
        p = make_problem(setup, shape, setup.decode_rows_mixed, setup.contexts[-1],
                         setup.chunk_plans[-1])
        scale = shape.head_dim ** -0.5
        ours = slot_attention(p.q, p.k[0], p.v[0], p.token_slots, p.contexts, scale=scale)
        ref = slot_attention_reference(p.q, p.k[0], p.v[0], p.token_slots, p.contexts,
                                       scale=scale)
        err = (ours.float() - ref.float()).abs().max().item()
        tol = 2e-2 if setup.dtype != torch.float32 else 1e-4
        if err > tol:
            raise AssertionError(f"{shape.name}: kernel differs from reference by {err}")
        print(f"correctness {shape.name} {setup.dtype}: max |kernel - reference| = {err:.2e}")


def decode_table(setup: Setup, copy_gbs: float | None) -> None:
    print(f"\n(1) decode attention, us per layer; model = gather W={setup.max_len} + SDPA "
          f"(as captured), ours = slot_attention; {setup.dtype}, {setup.layers} layers/call")
    print(f"{'shape':16} {'batch':>5} {'ctx':>5} {'model':>9} {'ours':>9} {'speedup':>8} "
          f"{'splits':>6} {'GB/s':>7} {'%copy':>6}")
    for shape in setup.shapes:
        scale = shape.head_dim ** -0.5
        for batch in setup.batches:
            for context in setup.contexts:
                p = make_problem(setup, shape, batch, context)
                model_us = time_us(model_fn(p, scale), setup.device) / setup.layers
                ours_us = time_us(ours_fn(p, scale), setup.device) / setup.layers
                splits = attention_kernel.choose_config(batch, shape.kv_heads, setup.max_len,
                                                        setup.device).num_splits
                gbs = p.bytes_read() / (ours_us * 1e-6) / 1e9
                pct = f"{100 * gbs / copy_gbs:5.0f}%" if copy_gbs else "     -"
                print(f"{shape.name:16} {batch:5d} {context:5d} {model_us:9.1f} {ours_us:9.1f} "
                      f"{model_us / ours_us:8.2f} {splits:6d} {gbs:7.0f} {pct}")
                del p


def mixed_table(setup: Setup) -> None:
    d = setup.decode_rows_mixed
    print(f"\n(2) mixed step attention, us per layer: {d} decode rows + prefill chunks ending "
          f"at the decode context; model = decode call + one SDPA per chunk")
    print(f"{'shape':16} {'chunks':>11} {'ctx':>5} {'model eager':>11} {'model graph':>11} "
          f"{'ours eager':>10} {'ours graph':>10} {'eager spd':>9} {'graph spd':>9}")
    for shape in setup.shapes:
        scale = shape.head_dim ** -0.5
        for chunk_lens in setup.chunk_plans:
            for context in setup.contexts:
                p = make_problem(setup, shape, d, context, chunk_lens)
                times = [time_us(fn(p, scale), setup.device, graph) / setup.layers
                         for fn in (model_fn, ours_fn) for graph in (False, True)]
                me, mg, oe, og = times
                label = f"{len(chunk_lens)}x{chunk_lens[0]}"
                print(f"{shape.name:16} {label:>11} {context:5d} {me:11.1f} {mg:11.1f} "
                      f"{oe:10.1f} {og:10.1f} {me / oe:9.2f} {mg / og:9.2f}")
                del p


def sweep(setup: Setup) -> None:
    """Decode time per launch config, to tune choose_config."""
    configs = [KernelConfig(block_n, splits, warps, stages)
               for block_n in (32, 64, 128) for splits in (1, 2, 4, 8)
               for warps in (4, 8) for stages in (2, 3)]
    print("\nsweep: decode us per layer by config (block_n/splits/warps/stages); best marked *")
    for shape in setup.shapes:
        scale = shape.head_dim ** -0.5
        for batch in setup.batches:
            for context in setup.contexts:
                p = make_problem(setup, shape, batch, context)
                times = {c: time_us(ours_fn(p, scale, c), setup.device) / setup.layers
                         for c in configs}
                best = min(times, key=times.get)
                cells = " ".join(f"{c.block_n}/{c.num_splits}/{c.num_warps}/{c.num_stages}="
                                 f"{t:.1f}{'*' if c == best else ''}" for c, t in times.items())
                print(f"{shape.name} b={batch} ctx={context}: {cells}")
                del p


def main() -> None:
    setup = make_setup(ARGS)
    if setup.device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/attention.py: no CUDA device (use --device cpu --tiny)")
    name = torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else \
        "cpu (Triton interpreter: times are not kernel performance)"
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}")
    copy_gbs = copy_bandwidth_gbs(setup.device)
    if copy_gbs:
        print(f"copy bandwidth: {copy_gbs:.0f} GB/s (device-to-device copy, read + write)")
    check_correctness(setup)
    decode_table(setup, copy_gbs)
    mixed_table(setup)
    if ARGS.sweep:
        sweep(setup)


if __name__ == "__main__":
    main()
