"""The model's two attention paths agree: one slot_attention launch per layer over every new
token of a mixed step (the CUDA path, graph-capturable; here the Triton kernel under the
interpreter) against SDPA per prefill chunk plus one batched decode call (the CPU path)."""

from __future__ import annotations

import torch

from gpu_worker.runtime.loader import load_model
from gpu_worker.runtime.model import ForwardBatch
from gpu_worker.runtime.parallel import TPGroup
from grammar_service.default_model import ensure_default_model


def test_mixed_step_logits_equal_with_slot_attention_and_sdpa(tmp_path):
    model_dir = ensure_default_model(tmp_path / "models")
    device = torch.device("cpu")
    results = []
    for slot_attention in (False, True):
        model = load_model(model_dir, TPGroup(0, 1, None, device), torch.float32, device)
        model.allocate_kv_cache(5, 64)
        # Step 1: three prompts prefilled in one step (slots 3, 0, 2).
        prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
        first = model(ForwardBatch.build([3, 0, 2], [0, 0, 0], prompts, device,
                                         slot_attention=slot_attention))
        # Step 2: two decode rows, one prefill continuation, one new chunk in another slot.
        second = model(ForwardBatch.build(
            [0, 3, 2, 1], [3, 5, 4, 0], [[20], [21], [22, 23, 24], [25, 26]], device,
            slot_attention=slot_attention))
        results.append((first, second))
    (a1, a2), (b1, b2) = results
    assert a1.shape == b1.shape == (3, a1.shape[1]) and a2.shape == (4, a1.shape[1])
    torch.testing.assert_close(b1, a1, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b2, a2, rtol=1e-4, atol=1e-4)
    assert torch.equal(a2.argmax(-1), b2.argmax(-1))
