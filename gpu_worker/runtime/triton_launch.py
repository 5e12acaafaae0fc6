"""Launching our Triton kernels from the engine's thread at the cost of a bare launch.

Triton's own launch path binds every argument and computes the specialisation key in Python
on each call: most of a small kernel's host cost, and the engine's thread is what bounds a
guided step. `FastLaunch` keeps the compiled kernel of each specialisation and calls it
directly. The first launch of a specialisation goes through Triton (which compiles it); off
CUDA (TRITON_INTERPRET=1 on the CPU) every launch does.
"""

from __future__ import annotations

import torch


def spec_key(args: tuple) -> tuple:
    """What Triton specialises a compiled kernel on, per launch argument: each pointer's dtype,
    device and 16-byte alignment, each int being 1, divisible by 16, or wider than 32 bits.
    Splitting finer than Triton does is harmless; coarser would reuse a kernel compiled for
    other assumptions, so every argument is in the key."""
    key = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            key.append((arg.dtype, arg.device.index, arg.data_ptr() % 16 == 0))
        else:
            key.append((arg == 1, arg % 16 == 0, arg >= 2**31))
    return tuple(key)


class FastLaunch:
    """Launches `kernel` (a @triton.jit function) with its compiled specialisations cached.

    `fast = False` routes every launch through Triton's own path (benchmarks compare both)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict[tuple, object] = {}
        self.fast = True

    def key(self, args: tuple, constexprs: tuple, num_warps: int) -> tuple:
        return (constexprs, num_warps, spec_key(args))

    def __call__(self, grid: tuple[int, int, int], args: tuple, constexprs: tuple,
                 num_warps: int, device: torch.device) -> None:
        if device.type != "cuda" or not self.fast:
            self.kernel[grid](*args, *constexprs, num_warps=num_warps)
            return
        key = self.key(args, constexprs, num_warps)
        compiled = self.compiled.get(key)
        if compiled is None:
            with torch.cuda.device(device):
                self.compiled[key] = self.kernel[grid](*args, *constexprs, num_warps=num_warps)
            return
        # Same call as Triton's own launch path, minus binding and key computation; launch
        # hooks (profilers that use them) are not called.
        stream = torch._C._cuda_getCurrentRawStream(device.index)
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function,
                     compiled.packed_metadata, None, None, None, *args, *constexprs)
