"""The model's two attention paths agree: one slot_attention launch per layer over every new
token of a mixed step (the CUDA path, graph-capturable; here the Triton kernel under the
interpreter) against SDPA per prefill chunk plus one batched decode call (the CPU path), for
the default model and for the families whose attention differs (Qwen3's q/k norms and wide
heads, Phi-3's fused projections, sliding window and partial rotary)."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.runtime.loader import load_model
from gpu_worker.runtime.model import ForwardBatch
from gpu_worker.runtime.parallel import TPGroup
from grammar_service.default_model import ensure_default_model


def _transformers_checkpoint(path, family: str, **kwargs):
    import transformers

    config = getattr(transformers, f"{family}Config")(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256, initializer_range=0.2, **kwargs)
    torch.manual_seed(0)
    getattr(transformers, f"{family}ForCausalLM")(config).save_pretrained(path)
    return path


CHECKPOINTS = {
    "default": lambda tmp: ensure_default_model(tmp / "models"),
    "qwen3": lambda tmp: _transformers_checkpoint(tmp / "qwen3", "Qwen3", head_dim=32),
    "phi3": lambda tmp: _transformers_checkpoint(
        tmp / "phi3", "Phi3", sliding_window=4, pad_token_id=0, rope_parameters=dict(
            rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
}


@pytest.mark.parametrize("family", list(CHECKPOINTS))
def test_mixed_step_logits_equal_with_slot_attention_and_sdpa(tmp_path, family):
    model_dir = CHECKPOINTS[family](tmp_path)
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


@pytest.mark.parametrize("slot_attention", [False, True])
def test_logits_at_several_positions_of_a_row_equal_one_token_a_step(tmp_path, slot_attention):
    """A row verifying drafts feeds several tokens and asks logits at each (`outputs`): they are
    the logits a decode of those tokens one per step gives, beside an ordinary decode row."""
    model_dir = ensure_default_model(tmp_path / "models")
    device = torch.device("cpu")
    model = load_model(model_dir, TPGroup(0, 1, None, device), torch.float32, device)
    model.allocate_kv_cache(3, 64)
    prompt, drafted = [5, 6, 7, 8], [30, 31, 32]
    model(ForwardBatch.build([0, 1], [0, 0], [prompt, prompt], device,
                             slot_attention=slot_attention))
    step = model(ForwardBatch.build([0, 1], [4, 4], [drafted, [40]], device,
                                    slot_attention=slot_attention, outputs=[3, 1]))
    assert step.shape[0] == 4
    one = [model(ForwardBatch.build([2], [0], [prompt + drafted[:1]], device,
                                    slot_attention=slot_attention))]
    for n, token in enumerate(drafted[1:], start=5):
        one.append(model(ForwardBatch.build([2], [n], [[token]], device,
                                            slot_attention=slot_attention)))
    torch.testing.assert_close(step[:3], torch.cat(one), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"outputs\[0\]"):
        ForwardBatch.build([0], [7], [[1, 2]], device, outputs=[3])
