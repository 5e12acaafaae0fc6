"""CUDA-graph replay of whole steps: decode rows and prefill chunks alike.

An eager step of a small model is bound by kernel launches (hundreds per step); a captured
graph replays them in one launch. With slot attention (attention_kernel.py) a step is N new
tokens, each with its own slot, position and context length, whatever mix of decode rows and
prefill chunks they form, so one graph per padded token count serves every step of that size:
prefill never forces a step off the graph. Token counts are padded up to the next bucket;
padding tokens write a dummy key into a scratch slot that no request owns. Each graph returns
the logits of up to `min(bucket, max_outputs)` tokens: each sequence's last new token, or its
last few for a row verifying drafted tokens; the rest are dropped. Every rank sees the same batches, so every rank captures the same graphs in
the same order (collectives inside a capture must match): `capture_all` at start-up.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gpu_worker.runtime.model import ForwardBatch, feed_indexed, output_index

# Token-count buckets: fine steps where decode batches live, coarser above (padding ≤ 25 %).
_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256,
            320, 384, 448, 512, 640, 768, 896, 1024)


# Rows of a graph's (7, size) int64 input buffer: the five the captured forward reads, then
# the feed's destination and source indices (see `run`), copied with them in one copy.
_IDS, _POSITIONS, _SLOTS, _CONTEXT, _LAST, _FEED_DST, _FEED_SRC = range(7)


class _Graph:
    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: Tensor, out: Tensor):
        self.graph, self.inputs, self.out = graph, inputs, out
        # Two pinned stagings for the step's inputs, used in turn and written in place through
        # NumPy views: one non-blocking copy, no allocation, no event per step (`run`).
        self.staging = [torch.empty(inputs.shape, dtype=inputs.dtype, pin_memory=True)
                        for _ in range(2)]
        self.words = [s.numpy() for s in self.staging]
        self.used = [0, 0]  # the StepGraphs.run call that last copied from each staging
        self.turn = 0


class StepGraphs:
    """Replays steps of up to `max_tokens` new tokens and `max_outputs` tokens with logits of
    `model`.

    `scratch_slot` is a KV-cache slot reserved for padding tokens (the model's cache must have
    it). `run` returns the (O, vocab) logits of the step's O output tokens, a view into the
    graph's static output that the next replay overwrites.
    """

    def __init__(self, model, max_tokens: int, max_outputs: int, scratch_slot: int):
        self.model = model
        self.max_outputs = max_outputs
        self.scratch_slot = scratch_slot
        self.device = model.tp.device
        self.sizes = [b for b in _BUCKETS if b < max_tokens] + [max_tokens]
        self.graphs: dict[int, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.calls = 0  # `run` calls so far
        # Every call up to this one has had its inputs copied on the device: the caller says
        # so (`done_through`) once it has synced on work queued after that call's replay.
        self.completed = 0

    def done_through(self, call: int) -> None:
        """The device has run everything queued up to `run` call number `call` (the caller
        synced on an event recorded after it): stagings copied by then may be rewritten."""
        self.completed = max(self.completed, call)

    def fits(self, num_tokens: int, num_outputs: int) -> bool:
        return num_tokens <= self.sizes[-1] and num_outputs <= self.max_outputs

    def capture_all(self) -> None:
        """Capture every bucket now (largest first, so smaller ones reuse its pool memory)."""
        for size in reversed(self.sizes):
            if size not in self.graphs:
                self._capture(size)

    def run(self, slots: list[int], starts: list[int], new_tokens: list[list[int]],
            feed: tuple[Tensor, list[int], list[int]] | None = None,
            outputs: list[int] | None = None) -> Tensor:
        """Replay the step. `feed` = (device tokens, dst, src): token dst[i] of the step is
        device_tokens[src[i]] (see feed_tokens), copied on the device after the inputs.
        `outputs` as in ForwardBatch.build (`fits` must allow their total)."""
        n = sum(len(t) for t in new_tokens)
        size = next(s for s in self.sizes if s >= n)
        g = self.graphs.get(size) or self._capture(size)
        ids, positions, token_slots = [], [], []
        for slot, start, tokens in zip(slots, starts, new_tokens, strict=True):
            ids.extend(tokens)
            positions.extend(range(start, start + len(tokens)))
            token_slots.extend([slot] * len(tokens))
        last = output_index([len(t) for t in new_tokens], outputs)
        # The host may rewrite a staging only once its last copy ran. This graph's two stagings
        # take turns, so that copy was queued at least two calls ago; the engine syncs every
        # step on the ids sampled from the step before (`done_through`), which covers it. Only
        # after steps that sampled nothing (no sync) does this wait for the device itself. An
        # event per step cost two GIL handoffs (record, synchronize) on the engine's thread.
        g.turn ^= 1
        if g.used[g.turn] > self.completed:
            torch.cuda.current_stream(self.device).synchronize()
            self.completed = self.calls
        w = g.words[g.turn]
        w[_IDS, :n], w[_IDS, n:] = ids, 0
        w[_POSITIONS, :n], w[_POSITIONS, n:] = positions, 0
        w[_SLOTS, :n], w[_SLOTS, n:] = token_slots, self.scratch_slot
        w[_CONTEXT, :n] = w[_POSITIONS, :n] + 1
        w[_CONTEXT, n:] = 1
        w[_LAST, :len(last)], w[_LAST, len(last):] = last, 0
        k = 0
        if feed is not None:
            source, dst, src = feed
            k = len(dst)
            w[_FEED_DST, :k], w[_FEED_SRC, :k] = dst, src
        g.inputs.copy_(g.staging[g.turn], non_blocking=True)
        self.calls += 1
        g.used[g.turn] = self.calls
        if k:  # token dst[i] of the step is source[src[i]], on the device
            feed_indexed(g.inputs[_IDS], source, g.inputs[_FEED_DST, :k],
                         g.inputs[_FEED_SRC, :k])
        g.graph.replay()
        return g.out[:len(last)]

    def _capture(self, size: int) -> _Graph:
        # A static batch whose tensors point at rows of one (7, size) input buffer: ids,
        # positions, slots, contexts, last index (then the feed's indices, which the graph does
        # not read). Its host-side lists (one placeholder token in the scratch slot) only pass
        # the forward's checks; slot attention reads the tensors.
        rows = min(size, self.max_outputs)
        batch = ForwardBatch.build([self.scratch_slot], [0], [[0]], self.device,
                                   slot_attention=True)
        inputs = torch.zeros((7, size), dtype=torch.int64, device=self.device)
        inputs[_SLOTS] = self.scratch_slot
        inputs[_CONTEXT] = 1
        batch.input_ids, batch.positions = inputs[_IDS], inputs[_POSITIONS]
        batch.token_slots, batch.token_context = inputs[_SLOTS], inputs[_CONTEXT]
        batch.last_index = inputs[_LAST, :rows]
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
