"""Applying a step's masks on a CPU worker: the Triton kernel in Triton's interpreter (how a CPU
worker applied them before) against xgrammar's C++ kernel (`masks.apply_token_bitmask_cpu_`,
what it uses now) and the plain PyTorch reference.

    PYTHONPATH=$PWD python bench/mask_cpu.py [--repeat 20]

Per case (guided rows x vocabulary: the default model's, and a 151k BPE's), random logits and
masks (a third of the tokens allowed), one torch thread: milliseconds per apply, the clone of
the logits it works on left out, and each against the C++ kernel. Every result is checked
against the reference first.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from gpu_worker.guided.mask_kernel import apply_token_bitmask_  # noqa: E402
from gpu_worker.guided.mask_reference import apply_token_bitmask_reference_  # noqa: E402
from gpu_worker.guided.masks import apply_token_bitmask_cpu_  # noqa: E402

CASES = ((38, 4032, 4000), (64, 4032, 4000), (64, 151936, 151646))  # rows, logits width, vocab
KERNELS = (("Triton kernel, interpreted", apply_token_bitmask_),
           ("PyTorch reference", apply_token_bitmask_reference_),
           ("xgrammar C++ (now)", apply_token_bitmask_cpu_))


def timed(fn, logits: torch.Tensor, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn(logits.clone())
    spent = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(repeat):
        logits.clone()
    return (spent - (time.perf_counter() - start)) / repeat


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=20, help="applies per kernel and case "
                   "(the interpreted kernel: a tenth, at least 2)")
    ns = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"# torch {torch.__version__}, one thread; ms per apply (the logits' clone left out)")
    print("| guided rows | logits width | " + " | ".join(n for n, _ in KERNELS)
          + " | interpreted ÷ C++ |")
    print("|--:|--:|" + "--:|" * (len(KERNELS) + 1))
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
        ms = []
        for _, kernel in KERNELS:
            def fn(x, kernel=kernel, bitmask=bitmask, index=index, vocab=vocab):
                kernel(x, bitmask, index, vocab)
                return x
            if not torch.equal(fn(logits.clone()), want):
                raise SystemExit(f"{kernel.__name__} disagrees with the reference")
            n = max(2, ns.repeat // 10) if kernel is apply_token_bitmask_ else ns.repeat
            ms.append(1e3 * timed(fn, logits, n))
        print(f"| {rows} | {width:,} | " + " | ".join(f"{m:,.2f}" for m in ms)
              + f" | {ms[0] / ms[-1]:,.0f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
