"""CUDA-graph replay of all-decode steps.

An eager decode step of a small model is bound by kernel launches (hundreds per step); a
captured graph replays them in one launch. One graph per padded batch size (1, 2, 4, ... up to
`max_batch`), captured on first use; padding rows decode a dummy token into a scratch slot
that no request owns, and their logits are dropped. Every rank sees the same batches, so every
rank captures the same graphs at the same step (collectives inside a capture must match).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gpu_worker.runtime.model import ForwardBatch


class _Graph:
    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: Tensor, out: Tensor):
        self.graph, self.inputs, self.out = graph, inputs, out
        # Pinned staging for the step's inputs: one non-blocking copy, no allocation per step.
        self.staging = torch.empty(inputs.shape, dtype=inputs.dtype, pin_memory=True)


class DecodeGraphs:
    """Replays all-decode steps of `model` through captured CUDA graphs.

    `scratch_slot` is a KV-cache slot reserved for padding rows (the model's cache must have
    it). `run` returns the (n, vocab) logits, a view into the graph's static output that the
    next replay overwrites.
    """

    def __init__(self, model, max_batch: int, scratch_slot: int):
        self.model = model
        self.scratch_slot = scratch_slot
        self.max_len = model.k_cache.shape[2]
        self.device = model.tp.device
        sizes, b = [], 1
        while b < max_batch:
            sizes.append(b)
            b *= 2
        self.sizes = [*sizes, max_batch]
        self.graphs: dict[int, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def fits(self, n: int) -> bool:
        return n <= self.sizes[-1]

    def run(self, slots: list[int], starts: list[int], tokens: list[int]) -> Tensor:
        n = len(slots)
        size = next(s for s in self.sizes if s >= n)
        g = self.graphs.get(size) or self._capture(size)
        pad = size - n
        positions = starts + [0] * pad
        # The previous step ended with a device sync, so the staging buffer is free.
        g.staging.copy_(torch.tensor([tokens + [0] * pad, positions,
                                      slots + [self.scratch_slot] * pad,
                                      [p + 1 for p in positions]], dtype=torch.int64))
        g.inputs.copy_(g.staging, non_blocking=True)
        g.graph.replay()
        return g.out[:n]

    def _capture(self, size: int) -> _Graph:
        # A static batch over distinct placeholder slots, its tensors then pointed at one
        # (4, size) input buffer: ids, positions, slots, context lengths.
        batch = ForwardBatch.build(list(range(size)), [0] * size, [[0]] * size, self.device,
                                   decode_window=self.max_len)
        inputs = torch.zeros((4, size), dtype=torch.int64, device=self.device)
        inputs[2] = self.scratch_slot
        inputs[3] = 1
        batch.input_ids, batch.positions = inputs[0], inputs[1]
        batch.token_slots = batch.decode_slots = inputs[2]
        batch.decode_context = inputs[3]
        batch.decode_slot_start = None  # always gather by slot index: slots vary per replay
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm up off the capture stream, as capture requires
            for _ in range(2):
                self.model(batch)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model(batch)
        self.graphs[size] = _Graph(graph, inputs, out)
        return self.graphs[size]
