"""The fused Gumbel-max kernel (under TRITON_INTERPRET=1) picks the same tokens as the
PyTorch sampling path it replaces on CUDA, row by row, whatever the batch."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from gpu_worker.sampling.kernel import gumbel_argmax  # noqa: E402
from gpu_worker.sampling.sampler import SamplingBatch, sample  # noqa: E402

# CPU tensors through Triton's interpreter against the PyTorch path on the CPU. With compiled
# Triton (TRITON_INTERPRET=0, a CUDA run of the suite) the kernels are checked in the engine:
# tests/test_worker_drafts.py's fused configuration against the op-by-op path.
pytestmark = pytest.mark.skipif(os.environ["TRITON_INTERPRET"] == "0",
                                reason="needs Triton's interpreter (CPU tensors)")


def _batch(temps, seeds, steps):
    n = len(temps)
    return SamplingBatch.from_lists(temps, [0] * n, [1.0] * n, [0.0] * n, seeds, steps)


@pytest.mark.parametrize("n_cols", [1, 37, 4096, 5000, 9001])
def test_kernel_matches_torch_path(n_cols):
    gen = torch.Generator().manual_seed(n_cols)
    logits = torch.randn(6, n_cols, generator=gen) * 3
    logits[2, : n_cols // 2] = float("-inf")  # a masked row
    temps = [1.0, 0.7, 1.3, 0.0, 2.0, 0.5]
    # 2**40 + 5 has high seed bits; -5 is the uint64 seed 2**64 - 5 as the int64 it travels as.
    params = _batch(temps, [1, 2, 3, 4, 2**40 + 5, -5], [0, 1, 2, 3, 4, 2**33 + 5])
    expected, _ = sample(logits, params)  # CPU tensors: the PyTorch path
    got = gumbel_argmax(logits, params.temperature, params.seed, params.step)
    assert got.tolist() == expected.tolist()


def test_kernel_row_result_independent_of_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3000, generator=gen)
    params = _batch([1.0] * 5, [9, 8, 7, 6, 5], [3] * 5)
    full = gumbel_argmax(logits, params.temperature, params.seed, params.step)
    for i in range(5):
        one = gumbel_argmax(logits[i:i + 1], params.temperature[i:i + 1], params.seed[i:i + 1],
                            params.step[i:i + 1])
        assert one.item() == full[i].item()


def test_kernel_rejects_half_precision_logits():
    with pytest.raises(ValueError, match="logits"):
        gumbel_argmax(torch.zeros(1, 8, dtype=torch.bfloat16), torch.ones(1),
                      torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))


def _reference_point(sources, temps, seeds, steps, mask_rows, bitmask, vocab, flag_single):
    """What the engine's op-by-op path gives: gather, padded ids -inf, mask in place, sample
    (the PyTorch path), then dead / non-finite / single-allowed."""
    from gpu_worker.guided.forced import single_allowed
    from gpu_worker.guided.mask_reference import apply_token_bitmask_reference_

    logits = torch.stack([t[i] for t, i in sources]).clone()
    logits[:, vocab:] = float("-inf")
    guided = [j for j, m in enumerate(mask_rows) if m >= 0]
    if guided:
        mask = torch.zeros((len(sources), bitmask.shape[1]), dtype=torch.int32)
        for j in guided:
            mask[j] = bitmask[mask_rows[j]]
        apply_token_bitmask_reference_(logits, mask, torch.tensor(guided), vocab)
    tokens, dead = sample(logits, _batch(temps, seeds, steps))
    broken = ~(logits < float("inf")).all(dim=-1)
    picked = torch.where(broken, -2, torch.where(dead, -1, tokens))
    wire = picked
    if flag_single:
        wire = torch.where(single_allowed(logits) & (picked >= 0), picked + (1 << 32), picked)
    return picked.clamp(min=0).tolist(), wire.tolist()


@pytest.mark.parametrize("flag_single", [False, True])
def test_sample_rows_is_the_op_by_op_sampling_point(flag_single):
    """Rows read through an index from two logits tensors, some masked by bitmask rows, padded
    ids past the vocabulary, a dead row, a NaN and a +inf among allowed tokens, a +inf that the
    mask refuses, a row with one allowed token, greedy and temperature rows, two column
    blocks: tokens and wire values equal the op-by-op path's."""
    from gpu_worker.guided.mask_reference import pack_bitmask
    from gpu_worker.sampling.kernel import sample_rows

    gen = torch.Generator().manual_seed(7)
    n_cols, vocab = 5000, 4990
    step_logits = torch.randn(6, n_cols, generator=gen) * 3
    saved = torch.randn(3, n_cols, generator=gen) * 3
    allow = torch.rand(5, n_cols, generator=gen) < 0.3
    allow[1] = False                       # bitmask row 1: a dead end
    allow[2] = False
    allow[2, 4321] = True                  # bitmask row 2: exactly one token (second block)
    allow[3] = torch.arange(n_cols) < 4400  # bitmask row 3: refuses 4500
    bitmask = pack_bitmask(allow)
    step_logits[3, 17] = float("nan")      # read unmasked by row 3: broken
    step_logits[4, 4500] = float("inf")    # read by row 4, whose mask refuses it
    saved[1, 99] = float("inf")            # read unmasked by row 7: broken
    # Rows 0-5 read the step's logits, rows 6-7 the saved ones, through `src`.
    src = [5, 0, 2, 3, 4, 1, 2, 1]
    parts_of = [step_logits] * 6 + [saved] * 2
    mask_rows = [0, -1, 1, -1, 3, -1, 2, -1]
    temps = [1.0, 0.0, 0.7, 1.0, 1.3, 0.0, 1.0, 2.0]
    seeds = [1, 2, 3, 4, 5, 6, 2**40 + 5, -5]
    steps = [0, 1, 2, 3, 4, 5, 6, 2**33 + 5]
    want = _reference_point(list(zip(parts_of, src, strict=True)), temps, seeds, steps,
                            mask_rows, bitmask, vocab, flag_single)
    params = _batch(temps, seeds, steps)
    out = sample_rows([(step_logits, 6), (saved, 2)], params.temperature, params.seed,
                      params.step, src=torch.tensor(src), mask_rows=torch.tensor(mask_rows),
                      bitmask=bitmask, vocab_size=vocab, flag_single=flag_single)
    assert (out[0].tolist(), out[1].tolist()) == want
    wire = want[1]
    assert wire[2] == -1 and wire[3] == -2 and wire[7] == -2
    assert 0 <= wire[4] < 4400 and min(wire[0], wire[1], wire[5]) >= 0
    assert (wire[6] >= 1 << 32) == flag_single and wire[6] % (1 << 32) == 4321


def test_sample_rows_checks_its_arguments():
    from gpu_worker.sampling.kernel import sample_rows

    params = _batch([1.0, 1.0], [1, 2], [0, 0])
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="parts"):
        sample_rows([(logits, 1)], params.temperature, params.seed, params.step)
    with pytest.raises(ValueError, match="src"):
        sample_rows([(logits, 1), (logits, 1)], params.temperature, params.seed, params.step)
    with pytest.raises(ValueError, match="bitmask"):
        sample_rows([(logits, 2)], params.temperature, params.seed, params.step,
                    mask_rows=torch.tensor([0, -1]))
    with pytest.raises(ValueError, match="logits"):
        sample_rows([(logits.half(), 2)], params.temperature, params.seed, params.step)
