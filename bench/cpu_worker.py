"""A CPU worker's per-step work on the logits: applying the guided rows' masks and sampling
with temperature, as it was against as it is now.

    PYTHONPATH=$PWD python bench/cpu_worker.py [--repeat 20]

Masks: our Triton kernel in Triton's interpreter (how a CPU worker applied them before)
against xgrammar's C++ kernel (`masks.apply_token_bitmask_cpu_`, now) and the plain PyTorch
reference. Sampling (temperature-only rows): the counter-based noise in int64 PyTorch ops
(`noise.noise_int64`, what the CPU ran before and CUDA runs outside the fused kernel)
against NumPy uint32 (`noise.noise_cpu`, now), and the exponential race on it as the
sampler made it before (allocating every pass) and now (`sampler.sample`). Per case (rows x
vocabulary: the default model's, and a 151k BPE's), random logits and masks (a quarter of
the tokens allowed), one torch thread: milliseconds per call, the clone of the logits a
mask apply works on left out. Every result is checked against the reference first (the
same bits, the same tokens).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from gpu_worker.guided.mask_kernel import apply_token_bitmask_  # noqa: E402
from gpu_worker.guided.mask_reference import apply_token_bitmask_reference_  # noqa: E402
from gpu_worker.guided.masks import apply_token_bitmask_cpu_  # noqa: E402
from gpu_worker.sampling.noise import noise_cpu, noise_int64, row_keys  # noqa: E402
from gpu_worker.sampling.sampler import SamplingBatch, sample  # noqa: E402

CASES = ((38, 4032, 4000), (64, 4032, 4000), (64, 151936, 151646))  # rows, logits width, vocab
MASKS = (("Triton kernel, interpreted (before)", apply_token_bitmask_),
         ("PyTorch reference", apply_token_bitmask_reference_),
         ("xgrammar C++ (now)", apply_token_bitmask_cpu_))


def per_call(fn, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def masks_table(repeat: int) -> None:
    print("| mask apply: guided rows | logits width | " + " | ".join(n for n, _ in MASKS)
          + " | before ÷ now |")
    print("|--:|--:|" + "--:|" * (len(MASKS) + 1))
    for rows, width, vocab in CASES:
        gen = torch.Generator().manual_seed(rows * width)
        logits = torch.randn(rows, width, generator=gen)
        words = (vocab + 31) // 32
        bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32,
                                generator=gen) & torch.randint(-2**31, 2**31 - 1, (rows, words),
                                                               dtype=torch.int32, generator=gen)
        index = torch.arange(rows)
        want = logits.clone()
        apply_token_bitmask_reference_(want, bitmask, index, vocab)
        clone = per_call(logits.clone, repeat)
        ms = []
        for _, kernel in MASKS:
            def fn(kernel=kernel, bitmask=bitmask, index=index, vocab=vocab, logits=logits):
                out = logits.clone()
                kernel(out, bitmask, index, vocab)
                return out
            if not torch.equal(fn(), want):
                raise SystemExit(f"{kernel.__name__} disagrees with the reference")
            n = max(2, repeat // 10) if kernel is apply_token_bitmask_ else repeat
            ms.append(1e3 * (per_call(fn, n) - clone))
        print(f"| {rows} | {width:,} | " + " | ".join(f"{m:,.2f}" for m in ms)
              + f" | {ms[0] / ms[-1]:,.0f}x |")


def race_before(logits: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
    """The sampler's temperature-only race as it was: int64 noise, every pass allocating."""
    noise = noise_int64(row_keys(params.seed, params.step), logits.shape[1])
    return (logits / params.temperature[:, None] - (-noise.log()).log()).argmax(dim=-1)


def sampling_table(repeat: int) -> None:
    print("| sampling: rows | vocabulary | noise int64 (before) | noise NumPy (now) | "
          "race before | `sample` now | before ÷ now |")
    print("|--:|--:|--:|--:|--:|--:|--:|")
    for rows, width, _ in CASES[1:]:
        gen = torch.Generator().manual_seed(width)
        logits = torch.randn(rows, width, generator=gen)
        params = SamplingBatch.from_lists([0.8] * rows, [0] * rows, [1.0] * rows,
                                          [0.0] * rows, list(range(rows)), list(range(rows)))
        key = row_keys(params.seed, params.step)
        if not torch.equal(noise_cpu(key, width), noise_int64(key, width)):
            raise SystemExit("the NumPy noise differs from the int64 noise")
        if not torch.equal(sample(logits, params)[0], race_before(logits, params)):
            raise SystemExit("the sampler's tokens differ from the race before")
        n = repeat if width < 10_000 else max(2, repeat // 10)
        ms = [1e3 * per_call(fn, n) for fn in (
            partial(noise_int64, key, width), partial(noise_cpu, key, width),
            partial(race_before, logits, params), partial(sample, logits, params))]
        print(f"| {rows} | {width:,} | " + " | ".join(f"{m:,.2f}" for m in ms)
              + f" | {ms[2] / ms[3]:,.1f}x |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=20,
                   help="calls per case (the interpreted kernel and 151k sampling: a tenth)")
    ns = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"# torch {torch.__version__}, one thread; ms per call")
    masks_table(ns.repeat)
    print()
    sampling_table(ns.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
