"""A single-rank engine in the test process: the real model, slot table, kernel and sampler,
driven step by step (no gRPC, no threads), for tests that need many requests quickly."""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from gpu_worker.control.engine import Engine, EngineConfig, Request  # noqa: E402
from gpu_worker.control.lockstep import ControlChannel  # noqa: E402
from gpu_worker.control.slots import SlotTable  # noqa: E402
from gpu_worker.runtime.loader import load_model  # noqa: E402
from gpu_worker.runtime.parallel import init_distributed  # noqa: E402
from grammar_service.vocab import load_vocab  # noqa: E402


@dataclass
class Outcome:
    tokens: list[int]
    reason: str
    message: str
    slot: int
    logprobs: list = None  # (logprob, top ids, top logprobs) per token, when asked


class EngineHarness:
    """One TP=1 engine over `model_dir`; `run` pushes requests through its slots."""

    def __init__(self, model_dir, slots: int = 4, max_model_len: int = 256, step_tokens: int = 64,
                 forced_tokens: bool = True, accept_first: bool = True, draft_tokens: int = 0,
                 fused_sampling: bool | None = None, triton_masks: bool | None = None):
        # GRAMSERVE_TEST_DEVICE=cuda runs the same tests on a GPU (compiled kernel, CUDA graphs).
        device = torch.device(os.environ.get("GRAMSERVE_TEST_DEVICE", "cpu"))
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", 0)
        self.vocab = load_vocab(model_dir)
        tp, _ = init_distributed(0, 1, "", device, 60.0)
        model = load_model(model_dir, tp, torch.float32, device)
        model.allocate_kv_cache(slots + 1, max_model_len)
        self.table = SlotTable(slots, is_rank0=True, admit_timeout_s=600)
        self._outputs: list = []
        self.engine = Engine(
            EngineConfig(num_slots=slots, max_model_len=max_model_len, step_tokens=step_tokens,
                         idle_poll_s=0.0, cuda_graph_max_tokens=step_tokens,
                         forced_tokens=forced_tokens, accept_first=accept_first,
                         draft_tokens=draft_tokens, fused_sampling=fused_sampling,
                         triton_masks=triton_masks),
            model, self.table, ControlChannel(None, 1), vocab_size=self.vocab.vocab_size,
            model_vocab_size=model.config.vocab_size, eos_token_ids=self.vocab.eos_token_ids,
            device=device, publish=self._outputs.extend)

    def run(self, requests: list[Request], release_after: dict[str, int] | None = None,
            max_steps: int = 100_000) -> dict[str, Outcome]:
        """Admit requests in order as slots free up; step until all finish.

        `release_after[id] = n` releases that request once it has streamed n tokens.
        """
        todo = deque(requests)
        live: dict[str, tuple[Request, object, list[int]]] = {}
        out: dict[str, Outcome] = {}
        release_after = release_after or {}
        for _ in range(max_steps):
            while todo and self.table.in_use() < self.table.num_slots:
                req = todo.popleft()
                entry = self.table.allocate(req.request_id, req)
                live[req.request_id] = (req, entry, [], [])
            if not live:
                return out
            self.engine.step()
            outputs, self._outputs[:] = list(self._outputs), []
            for o in outputs:
                rid = o.req.request_id
                req, entry, toks, lps = live[rid]
                toks.extend(o.tokens)
                lps.extend(o.logprobs)
                if rid in release_after and len(toks) >= release_after[rid] and o.finish is None:
                    release_after.pop(rid)
                    self.table.request_release(entry.slot, rid)
                if o.finish is not None:
                    out[rid] = Outcome(toks, o.finish.reason, o.finish.message, entry.slot, lps)
                    del live[rid]
        raise AssertionError("requests did not finish")
