"""Benchmark of the bitmask kernel on a GPU: ours vs xgrammar (Triton and CUDA) vs plain PyTorch.

Prints, from one run: the device's copy bandwidth; a correctness check of the compiled kernel
against the reference (awkward shapes, strides, row subsets, CUDA-graph replay); optionally a
sweep of launch configs; then for each dtype, batch B, vocab V and guided fraction the time
of each implementation, its effective GB/s (bytes the op must move: read + write of the
guided logits rows plus their mask rows), the fraction of copy bandwidth and ours/xgrammar;
and the host-side cost of one launch.

    python bench/mask_kernel.py [--sweep] [--out FILE]

Needs CUDA. Imports neither protos nor grpc.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_worker.guided import mask_kernel  # noqa: E402
from gpu_worker.guided.mask_kernel import KernelConfig, apply_token_bitmask_  # noqa: E402
from gpu_worker.guided.mask_reference import (  # noqa: E402
    apply_token_bitmask_reference_,
    check_mask_args,
    pack_bitmask,
)

BATCHES = (1, 16, 64, 256)
VOCABS = (32000, 128256, 151936)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ALLOWED_FRACTION = 0.01


class Report:
    """Prints lines and keeps them for the output file."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second, in GB/s."""
    src = torch.empty(2**29, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def random_problem(n_batch: int, n_cols: int, dtype: torch.dtype, seed: int = 0):
    """Random logits (B, V) and a bitmask allowing ~1 % of tokens, on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(n_batch, n_cols, device="cuda", generator=gen).to(dtype)
    allowed = torch.rand(n_batch, n_cols, device="cuda", generator=gen) < ALLOWED_FRACTION
    return logits, pack_bitmask(allowed)


def check_correctness(report: Report) -> None:
    """Compiled kernel vs reference, bit for bit, on shapes chosen to break specialisation."""
    cases = [  # (B, V, W or None, vocab_size, dtype, rows, column offset of a logits slice)
        (4, 1, None, None, torch.float32, None, 0),
        (4, 31, None, None, torch.bfloat16, [2], 0),
        (5, 33, None, None, torch.float16, [4, 0, 2], 0),
        (3, 4095, None, None, torch.float32, [], 0),
        (6, 4160, 100, None, torch.bfloat16, None, 0),
        (7, 32007, None, 32000, torch.float32, [6, 1, 3], 0),
        (7, 32007, None, 32000, torch.float32, [6, 1, 3], 1),
        (9, 151936, None, 151665, torch.bfloat16, list(range(0, 9, 2)), 3),
        (64, 128256, None, None, torch.float16, None, 0),
        (256, 151936, None, None, torch.float32, None, 0),
    ]
    for n_batch, n_cols, n_words, vocab_size, dtype, rows, offset in cases:
        n_words = n_words or triton.cdiv(n_cols, 32)
        big = torch.randn(n_batch, n_cols + 8, device="cuda").to(dtype)
        logits = big[:, offset:offset + n_cols]
        bitmask = pack_bitmask(torch.rand(n_batch, 32 * n_words, device="cuda") < 0.3)
        rows_t = None if rows is None else torch.tensor(rows, dtype=torch.int32, device="cuda")
        ours, ref = big.clone(), big.clone()
        for _ in range(2):  # the second call takes the cached fast launch
            apply_token_bitmask_(ours[:, offset:offset + n_cols], bitmask, rows_t, vocab_size)
        apply_token_bitmask_reference_(ref[:, offset:offset + n_cols], bitmask, rows_t, vocab_size)
        if not torch.equal(ours, ref):
            raise AssertionError(f"kernel != reference for B={n_batch} V={n_cols} {dtype}")
    # Graph capture: the launch must be capturable and replay correctly.
    logits, bitmask = random_problem(64, 151936, torch.float32, seed=1)
    rows_t = torch.arange(0, 64, 2, dtype=torch.int64, device="cuda")
    ref = logits.clone()
    apply_token_bitmask_reference_(ref, bitmask, rows_t)
    apply_token_bitmask_(logits.clone(), bitmask, rows_t)  # compile outside the capture
    work = logits.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_token_bitmask_(work, bitmask, rows_t)
    work.copy_(logits)
    graph.replay()
    torch.cuda.synchronize()
    if not torch.equal(work, ref):
        raise AssertionError("kernel in a CUDA graph != reference")
    report(f"correctness: {len(cases)} shapes + CUDA graph replay match the reference bit for bit")


def xgrammar_backends(report: Report) -> dict:
    """xgrammar's GPU backends that work here, by name."""
    try:
        import xgrammar
    except ImportError as exc:
        report(f"xgrammar unavailable: {exc}")
        return {}
    backends = {}
    logits, bitmask = random_problem(2, 1000, torch.float32)
    for name in ("triton", "cuda"):
        try:
            t0 = time.perf_counter()
            xgrammar.apply_token_bitmask_inplace(logits, bitmask, backend=name)
            torch.cuda.synchronize()
            report(f"xgrammar {version('xgrammar')} backend={name}: ready in "
                   f"{time.perf_counter() - t0:.1f} s (first call, includes its compile)")
            backends[name] = (lambda n: lambda lg, bm, idx: xgrammar.apply_token_bitmask_inplace(
                lg, bm, indices=idx, backend=n))(name)
        except Exception as exc:  # noqa: BLE001 - a missing backend is reported, not fatal
            report(f"xgrammar backend={name} unavailable: {type(exc).__name__}: {exc}")
    return backends


def sweep(report: Report) -> None:
    """Time launch configs on large and small shapes, to pick the table in mask_kernel."""
    report("\nsweep: us per call (rows x V), all rows guided")
    shapes = ((256, 151936), (64, 128256), (16, 32000), (1, 151936))
    for dtype_name, dtype in DTYPES.items():
        report(f"{dtype_name}: " + "  ".join(f"{b}x{v}" for b, v in shapes))
        problems = [random_problem(b, v, dtype) for b, v in shapes]
        for block_words, num_warps in itertools.product((32, 64, 128, 256), (2, 4, 8)):
            config = KernelConfig(block_words, num_warps)
            times = []
            for logits, bitmask in problems:
                n_valid = logits.shape[1]
                ms = triton.testing.do_bench(lambda lg=logits, bm=bitmask, n=n_valid, c=config:
                                             mask_kernel._launch(lg, bm, None, n, c),
                                             warmup=10, rep=40)
                times.append(f"{ms * 1e3:8.1f}")
            report(f"  words={block_words:4d} warps={num_warps}: " + " ".join(times))


def effective_gbs(n_rows: int, n_cols: int, dtype: torch.dtype, ms: float) -> float:
    moved = n_rows * n_cols * dtype.itemsize * 2 + n_rows * triton.cdiv(n_cols, 32) * 4
    return moved / (ms * 1e-3) / 1e9


def time_case(backends: dict, logits: torch.Tensor, bitmask: torch.Tensor,
              rows: list[int] | None) -> dict[str, float]:
    """Microseconds per call of each implementation on one problem (L2 flushed between calls)."""
    rows_t = None if rows is None else torch.tensor(rows, device="cuda")
    fns = {"ours": lambda: apply_token_bitmask_(logits, bitmask, rows_t)}
    for name, fn in backends.items():
        fns[f"xgr-{name}"] = (lambda f: lambda: f(logits, bitmask, rows))(fn)
    fns["torch"] = lambda: apply_token_bitmask_reference_(logits, bitmask, rows_t)
    return {n: triton.testing.do_bench(f, warmup=10, rep=50) * 1e3 for n, f in fns.items()}


def compare(report: Report, backends: dict, copy_gbs: float) -> None:
    """The main table: every implementation side by side for every shape."""
    names = ["ours"] + [f"xgr-{n}" for n in backends] + ["torch"]
    report("\ntimes in us; GB/s = (2 * guided rows * V * itemsize + mask bytes) / time; "
           "%copy = GB/s / copy GB/s; ratio = ours / xgrammar time (< 1: ours faster)")
    header = f"{'dtype':5} {'B':>4} {'V':>6} {'rows':>4} " + " ".join(f"{n:>10}" for n in names)
    header += f" {'ours GB/s':>9} {'%copy':>6} " + " ".join(f"{'/' + n:>12}" for n in backends)
    report(header)
    for dtype_name, dtype in DTYPES.items():
        for n_cols in VOCABS:
            for n_batch in BATCHES:
                logits, bitmask = random_problem(n_batch, n_cols, dtype)
                for half in (False, True):
                    if half and n_batch == 1:
                        continue
                    rows = list(range(0, n_batch, 2)) if half else None
                    us = time_case(backends, logits, bitmask, rows)
                    n_rows = n_batch if rows is None else len(rows)
                    gbs = effective_gbs(n_rows, n_cols, dtype, us["ours"] * 1e-3)
                    line = f"{dtype_name:5} {n_batch:4d} {n_cols:6d} {n_rows:4d} "
                    line += " ".join(f"{us[n]:10.1f}" for n in names)
                    line += f" {gbs:9.0f} {100 * gbs / copy_gbs:5.0f}% "
                    line += " ".join(f"{us['ours'] / us['xgr-' + n]:12.2f}" for n in backends)
                    report(line)


def host_cost(report: Report, backends: dict) -> None:
    """Host time per launch: N launches back to back without sync, on a tiny problem, with the
    parts of our launch timed alone (argument checks, config and key; the bare kernel.run)."""
    logits, bitmask = random_problem(1, 32000, torch.float32)
    rows_t = torch.zeros(1, dtype=torch.int32, device="cuda")
    apply_token_bitmask_(logits, bitmask)
    config = mask_kernel.choose_config(4, 1, 32000)
    args = (logits, logits.stride(0), bitmask, bitmask.stride(0), bitmask, 1, 1, 32000, 32000, 1000)
    launcher = mask_kernel.launcher
    constexprs = (False, config.block_words)
    kernel = launcher.compiled[launcher.key(args, constexprs, config.num_warps)]
    stream = torch.cuda.current_stream().cuda_stream

    def python_side():
        check_mask_args(logits, bitmask, None, None)
        c = mask_kernel.choose_config(4, 1, 32000)
        launcher.key(args, (False, c.block_words), c.num_warps)

    def bare_run():
        kernel.run(1, 32, 1, stream, kernel.function, kernel.packed_metadata, None, None, None,
                   *args, False, config.block_words)

    def triton_jit_launch():
        launcher.fast = False
        apply_token_bitmask_(logits, bitmask)
        launcher.fast = True

    fns = {"torch logits.neg_() (native launch)": logits.neg_,
           "ours: checks + config + key only": python_side,
           "ours: bare kernel.run only": bare_run,
           "ours (rows=None)": lambda: apply_token_bitmask_(logits, bitmask),
           "ours (rows tensor)": lambda: apply_token_bitmask_(logits, bitmask, rows_t),
           "ours through Triton's JIT launch": triton_jit_launch}
    for n, fn in backends.items():
        fns[f"xgrammar {n} (indices=None)"] = (lambda f: lambda: f(logits, bitmask, None))(fn)
        fns[f"xgrammar {n} (indices=[0])"] = (lambda f: lambda: f(logits, bitmask, [0]))(fn)
    graph = torch.cuda.CUDAGraph()
    apply_token_bitmask_(logits, bitmask, rows_t)
    with torch.cuda.graph(graph):
        apply_token_bitmask_(logits, bitmask, rows_t)
    fns["ours, CUDA graph replay"] = graph.replay
    report("\nhost time per call (us), 2000 calls without sync, B=1 V=32000 fp32")
    for name, fn in fns.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(2000):
            fn()
        host_us = (time.perf_counter() - t0) / 2000 * 1e6
        torch.cuda.synchronize()
        report(f"  {name:40} {host_us:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time a grid of launch configs")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/mask_kernel.py needs a CUDA device")
    report = Report()
    report(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
           f"triton {triton.__version__}; ~{100 * ALLOWED_FRACTION:.0f}% of tokens allowed")
    copy_gbs = copy_bandwidth_gbs()
    report(f"copy bandwidth: {copy_gbs:.0f} GB/s (device-to-device copy, read + write)")
    check_correctness(report)
    backends = xgrammar_backends(report)
    if args.sweep:
        sweep(report)
    report(f"\nconfigs in use: {mask_kernel._CONFIGS} small: {mask_kernel._SMALL_CONFIG}")
    compare(report, backends, copy_gbs)
    host_cost(report, backends)
    if args.out:
        args.out.write_text("\n".join(report.lines) + "\n")


if __name__ == "__main__":
    main()
